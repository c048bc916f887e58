//! A device for tests of wrappers: it keeps its data in a memory device, answers every
//! question of the `Device` trait that a wrapper should pass on with what no default
//! answers, and records the power cuts and the calls it receives. A wrapper over it must
//! answer and pass on the same.

use std::rc::Rc;
use std::sync::{Arc, Mutex};

use cairn_core::{Core, Device, Error, Extent, Geometry, LostWrites, Queue};

/// What reached a [`Probe`] through a wrapper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// [`Device::power_cut`].
    PowerCut,
    /// [`Device::power_cut_torn`], with its seed.
    PowerCutTorn(u64),
    /// [`Device::lost_writes_made_up`].
    LostWritesMadeUp,
}

/// A memory device of `bytes` that is read-only, not coherent across queues and has
/// lost writes (none of the defaults), and records what it is told.
pub struct Probe {
    mem: Arc<dyn Device>,
    calls: Mutex<Vec<Call>>,
}

impl Probe {
    /// A probe named `name` over a memory device of `bytes` (4 KiB blocks).
    pub fn new(name: &str, bytes: u64) -> Probe {
        let spec = cairn_leaves::LeafSpec::parse(&format!("mem:{bytes},block=4k"))
            .expect("a memory device's spec");
        Probe {
            mem: cairn_leaves::open(&spec, name).expect("a memory device"),
            calls: Mutex::new(Vec::new()),
        }
    }

    /// What it was told so far, in order; then forgets it.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn note(&self, call: Call) {
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(call);
    }
}

impl Device for Probe {
    fn name(&self) -> &str {
        self.mem.name()
    }
    fn describe(&self) -> String {
        format!("probe over {}", self.mem.describe())
    }
    fn geometry(&self) -> Geometry {
        self.mem.geometry()
    }
    fn open_queue(&self, core: &Rc<Core>) -> Result<Rc<dyn Queue>, Error> {
        self.mem.open_queue(core)
    }
    fn extents(&self, offset: u64, len: u64, out: &mut Vec<Extent>) -> Result<(), Error> {
        self.mem.extents(offset, len, out)
    }
    fn power_cut(&self) {
        self.note(Call::PowerCut);
    }
    fn power_cut_torn(&self, seed: u64) {
        self.note(Call::PowerCutTorn(seed));
    }
    fn coherent_across_queues(&self) -> bool {
        false
    }
    fn lost_writes(&self) -> LostWrites {
        LostWrites::Lost
    }
    fn lost_writes_made_up(&self) {
        self.note(Call::LostWritesMadeUp);
    }
    fn read_only(&self) -> bool {
        true
    }
}
