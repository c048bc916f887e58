//! LUKS version 2 (being written).
