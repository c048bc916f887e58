//! The exports a server offers: those it starts with, and read-only ones an operator
//! adds and removes while it runs (`cairn admin SOCKET export add|remove`: a thin pool's
//! snapshot served to a backup client, say).
//!
//! A handshake works on a copy of the list taken when it starts; the connection keeps
//! its export (and so its device) for as long as it lives. A removed export takes no new
//! connections; its device closes once the last connection to it ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::proto::tflags;
use crate::server::conn::Export;
use crate::server::gate::Gate;
use crate::server::handshake::Catalog;

/// One export in the table.
pub struct Listed {
    /// Unique for the server's life (a name can come back as another export).
    pub(crate) id: u64,
    /// What it is.
    pub export: Export,
    /// The gate its writes pass (exports of the start only; added ones are read-only).
    pub(crate) gate: Option<Arc<Gate>>,
    /// Added while the server runs (its reactors' queues close with its last
    /// connection).
    pub(crate) added: bool,
    /// Connections to it.
    pub(crate) conns: AtomicUsize,
}

impl Listed {
    /// Whether it was added while serving.
    pub fn added(&self) -> bool {
        self.added
    }
}

/// The exports served now.
#[derive(Default)]
pub struct ExportTable {
    live: RwLock<Vec<Arc<Listed>>>,
    next: AtomicU64,
}

impl ExportTable {
    /// An empty table, filled by [`crate::serve`] with the exports it starts with.
    pub fn new() -> Arc<ExportTable> {
        Arc::new(ExportTable::default())
    }

    fn list(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Listed>>> {
        self.live.read().unwrap_or_else(|p| p.into_inner())
    }

    fn list_mut(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Listed>>> {
        self.live.write().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn start(&self, exports: Vec<(Export, Option<Arc<Gate>>)>) {
        let mut list = self.list_mut();
        for (export, gate) in exports {
            list.push(Arc::new(Listed {
                id: self.next.fetch_add(1, Ordering::Relaxed),
                export,
                gate,
                added: false,
                conns: AtomicUsize::new(0),
            }));
        }
    }

    /// Takes every export out (serving has ended): the caller drops them, and so closes
    /// their devices, whoever else still holds the table.
    pub(crate) fn close(&self) -> Vec<Arc<Listed>> {
        std::mem::take(&mut *self.list_mut())
    }

    /// The exports now, in the order they are listed.
    pub fn snapshot(&self) -> Vec<Arc<Listed>> {
        self.list().clone()
    }

    /// The catalog clients see of `exports`.
    pub(crate) fn catalog(exports: &[Arc<Listed>]) -> Catalog {
        Catalog {
            exports: exports.iter().map(|l| l.export.info.clone()).collect(),
        }
    }

    /// Adds `export`, read-only whatever its flags say. Refused when its name is empty
    /// or taken.
    pub fn add(&self, mut export: Export) -> Result<(), String> {
        let name = export.info.name.clone();
        if name.is_empty() {
            return Err("an added export needs a name".into());
        }
        let mut list = self.list_mut();
        if list.iter().any(|l| l.export.info.name == name) {
            return Err(format!("an export named '{name}' is served already"));
        }
        export.info.flags = (export.info.flags | tflags::READ_ONLY | tflags::CAN_MULTI_CONN)
            & !(tflags::SEND_FUA
                | tflags::SEND_TRIM
                | tflags::SEND_WRITE_ZEROES
                | tflags::SEND_FAST_ZERO);
        export.info.default = false;
        list.push(Arc::new(Listed {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            export,
            gate: None,
            added: true,
            conns: AtomicUsize::new(0),
        }));
        Ok(())
    }

    /// Removes export `name` (one added while serving): no new connection reaches it;
    /// those connected keep it until they end. Returns how many are connected.
    pub fn remove(&self, name: &str) -> Result<usize, String> {
        let mut list = self.list_mut();
        let Some(i) = list.iter().position(|l| l.export.info.name == name) else {
            return Err(format!("no export named '{name}'"));
        };
        if !list[i].added {
            return Err(format!(
                "export '{name}' is from the start (the stack file or the command line): only exports added with 'export add' are removed"
            ));
        }
        Ok(list.remove(i).conns.load(Ordering::Relaxed))
    }
}
