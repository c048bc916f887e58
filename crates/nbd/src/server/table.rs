//! The exports a server offers: those it starts with, and those an operator adds and
//! removes while it runs (`cairn admin SOCKET export add|remove`: a thin pool's snapshot
//! served read-only to a backup client, say, or a volume made online served writable).
//!
//! A handshake works on a copy of the list taken when it starts; the connection keeps
//! its export (and so its device) for as long as it lives. A removed export takes no new
//! connections; its device closes once the last connection to it ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use crate::proto::tflags;
use crate::server::conn::Export;
use crate::server::gate::{Gate, Wake};
use crate::server::handshake::Catalog;

/// One export in the table.
pub struct Listed {
    /// Unique for the server's life (a name can come back as another export).
    pub(crate) id: u64,
    /// What it is.
    pub export: Export,
    /// The gate its writes pass (a writable export that may see unaligned requests).
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
    /// How a gate of an export added while serving wakes the reactors, and how many
    /// they are (set when serving starts).
    gates: std::sync::OnceLock<(Arc<Wake>, usize)>,
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

    pub(crate) fn start(
        &self,
        exports: Vec<(Export, Option<Arc<Gate>>)>,
        (wake, reactors): (Arc<Wake>, usize),
    ) {
        let _ = self.gates.set((wake, reactors));
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

    /// The catalog clients see of `exports`, with each device's size now (a thin volume
    /// grown while serving is seen by the next connection at its new size).
    pub(crate) fn catalog(exports: &[Arc<Listed>]) -> Catalog {
        Catalog {
            exports: exports
                .iter()
                .map(|l| {
                    let mut info = l.export.info.clone();
                    info.size = l.export.device.geometry().size_bytes;
                    info
                })
                .collect(),
        }
    }

    /// Adds `export`: read-only whatever its flags say unless `writable`. Refused when its
    /// name is empty or taken.
    pub fn add(&self, mut export: Export, writable: bool) -> Result<(), crate::Error> {
        let name = export.info.name.clone();
        if name.is_empty() {
            return Err(crate::Error::ExportUnnamed);
        }
        let mut list = self.list_mut();
        if list.iter().any(|l| l.export.info.name == name) {
            return Err(crate::Error::ExportExists(name));
        }
        if !writable {
            export.info.flags = (export.info.flags | tflags::READ_ONLY | tflags::CAN_MULTI_CONN)
                & !(tflags::SEND_FUA
                    | tflags::SEND_TRIM
                    | tflags::SEND_WRITE_ZEROES
                    | tflags::SEND_FAST_ZERO);
        }
        export.info.default = false;
        // A writable export that may see unaligned requests orders their
        // read-modify-writes against its other writes, as one of the start does.
        let gate = match self.gates.get() {
            Some((wake, reactors)) if writable && !export.strict_alignment => {
                Some(Arc::new(Gate::new(*reactors, wake.clone())))
            }
            _ => None,
        };
        list.push(Arc::new(Listed {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            export,
            gate,
            added: true,
            conns: AtomicUsize::new(0),
        }));
        Ok(())
    }

    /// Removes export `name` (one added while serving): no new connection reaches it;
    /// those connected keep it until they end. Returns how many are connected.
    pub fn remove(&self, name: &str) -> Result<usize, crate::Error> {
        let mut list = self.list_mut();
        let Some(i) = list.iter().position(|l| l.export.info.name == name) else {
            return Err(crate::Error::NoExport(name.to_string()));
        };
        if !list[i].added {
            return Err(crate::Error::ExportFromStart(name.to_string()));
        }
        Ok(list.remove(i).conns.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use cairn_core::{Caps, Core, Device, Geometry, Queue};

    use super::*;
    use crate::ExportInfo;

    /// A device that is only ever listed, never opened.
    struct Listed0;

    impl Device for Listed0 {
        fn name(&self) -> &str {
            "d"
        }
        fn describe(&self) -> String {
            String::new()
        }
        fn geometry(&self) -> Geometry {
            Geometry {
                size_bytes: 1 << 20,
                block_bytes: 512,
                caps: Caps::ALL,
            }
        }
        fn open_queue(&self, _core: &Rc<Core>) -> Result<Rc<dyn Queue>, cairn_core::Error> {
            Err(cairn_core::Error::Invalid("never opened".into()))
        }
    }

    fn export(name: &str) -> Export {
        Export {
            info: ExportInfo {
                name: name.into(),
                description: String::new(),
                size: 1 << 20,
                flags: 0,
                min_block: 512,
                preferred_block: 4096,
                max_payload: 1 << 20,
                default: false,
            },
            device: Arc::new(Listed0),
            strict_alignment: false,
        }
    }

    /// The admin's export changes are refused as values it can reply from: a name taken,
    /// no name, a name not served, an export from the start.
    #[test]
    fn export_changes_are_refused_as_values() {
        let table = ExportTable::new();
        table.start(
            vec![(export("first"), None)],
            (Arc::new(Wake::new(Vec::new())), 1),
        );
        table.add(export("snap"), false).expect("added");
        let e = table.add(export("snap"), false).unwrap_err();
        assert_eq!(e, crate::Error::ExportExists("snap".into()));
        assert_eq!(e.to_string(), "an export named 'snap' is served already");
        assert_eq!(
            table.add(export(""), false),
            Err(crate::Error::ExportUnnamed)
        );
        assert_eq!(
            table.remove("nosuch"),
            Err(crate::Error::NoExport("nosuch".into()))
        );
        assert_eq!(
            table.remove("first"),
            Err(crate::Error::ExportFromStart("first".into()))
        );
        assert_eq!(table.remove("snap"), Ok(0));
    }
}
