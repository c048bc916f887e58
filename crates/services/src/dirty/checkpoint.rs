//! Checkpoints in a bitmap store: the turn of a thin volume's bitmaps at its
//! checkpoint's snapshot, settled at open when a stop came in between, and the bitmaps
//! of deleted snapshots dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_core::Error;

use super::bitmap::Bitmap;
use super::error::DirtyError;
use super::format::{self, CHECKPOINT, DISABLED, PENDING};
use super::store::{State, Store, GRANULARITY};

impl Store {
    /// The first step of checkpoint `name`, taken while writes are held and none is in
    /// flight, before its snapshot: a new enabled bitmap `name` (pending until
    /// [`Store::checkpoint_end`]), and the volume's current checkpoint bitmap, if any,
    /// disabled and attached to snapshot `name`. The new bitmap has `granularity`, else
    /// the previous one's, else [`GRANULARITY`]. Returns the previous checkpoint's name.
    pub fn checkpoint_begin(
        &self,
        name: &str,
        granularity: Option<u64>,
    ) -> Result<Option<String>, DirtyError> {
        format::check_name(name)?;
        self.refuse_dry()?;
        let mut st = self.lock();
        if st.bitmaps.iter().any(|b| b.name == name) {
            return Err(DirtyError::Exists {
                name: name.to_string(),
                checkpoint: true,
            });
        }
        let prev = st
            .bitmaps
            .iter()
            .find(|b| b.enabled() && b.has(CHECKPOINT) && b.owner().is_empty())
            .cloned();
        let granularity =
            granularity.unwrap_or_else(|| prev.as_ref().map_or(GRANULARITY, |p| 1 << p.shift));
        let e = self.new_entry(&st, name, granularity, CHECKPOINT | PENDING)?;
        st.bitmaps.push(Arc::new(Bitmap::new(&e)));
        if let Some(p) = &prev {
            p.flags.fetch_or(DISABLED, Ordering::Relaxed);
            p.set_owner(name);
        }
        if let Err(err) = self.commit(&mut st) {
            st.bitmaps.pop();
            if let Some(p) = &prev {
                p.flags.fetch_and(!DISABLED, Ordering::Relaxed);
                p.set_owner("");
            }
            return Err(err.into());
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(prev.map(|p| p.name.clone()))
    }

    /// The last step of checkpoint `name`: its snapshot was taken (`taken`), or not, and
    /// then the first step is undone. A failure to write is logged: the next open
    /// finishes or undoes the checkpoint from what the pool holds.
    pub fn checkpoint_end(&self, name: &str, taken: bool) {
        let mut st = self.lock();
        self.settle(&mut st, name, taken);
        if let Err(e) = self.commit(&mut st) {
            log::error!("cairn: {e} (checkpoint '{name}' is settled at the next start)");
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Finishes (`taken`) or undoes checkpoint `name` in memory.
    fn settle(&self, st: &mut State, name: &str, taken: bool) {
        if taken {
            for b in st.bitmaps.iter().filter(|b| b.name == name) {
                b.flags.fetch_and(!PENDING, Ordering::Relaxed);
            }
            return;
        }
        st.bitmaps
            .retain(|b| b.name != name || !b.owner().is_empty());
        for b in st.bitmaps.iter().filter(|b| b.owner() == name) {
            b.flags.fetch_and(!DISABLED, Ordering::Relaxed);
            b.set_owner("");
        }
    }

    /// At open, with the snapshots of the device's pool: checkpoints left pending by a
    /// stop are finished or undone, and bitmaps of snapshots deleted meanwhile go.
    pub fn reconcile(&self, exists: &dyn Fn(&str) -> bool) -> Result<(), Error> {
        if self.dry {
            return Ok(());
        }
        let mut st = self.lock();
        let pending: Vec<String> = st
            .bitmaps
            .iter()
            .filter(|b| b.has(PENDING))
            .map(|b| b.name.clone())
            .collect();
        let gone: Vec<String> = st
            .bitmaps
            .iter()
            .map(|b| b.owner())
            .filter(|o| !o.is_empty() && !pending.contains(o) && !exists(o))
            .collect();
        if pending.is_empty() && gone.is_empty() {
            return Ok(());
        }
        for name in &pending {
            let taken = exists(name);
            log::info!(
                "cairn: bitmap store {}: checkpoint '{name}' {} at the last stop",
                self.path.display(),
                if taken {
                    "finished (its snapshot exists)"
                } else {
                    "undone (its snapshot was never taken)"
                }
            );
            self.settle(&mut st, name, taken);
        }
        st.bitmaps.retain(|b| !gone.contains(&b.owner()));
        self.commit(&mut st)?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Removes the bitmaps attached to snapshot `owner` (it was deleted).
    pub fn drop_owner(&self, owner: &str) -> Result<(), DirtyError> {
        let mut st = self.lock();
        if !st.bitmaps.iter().any(|b| b.owner() == owner) {
            return Ok(());
        }
        if let Some(b) = st.bitmaps.iter().find(|b| b.owner() == owner) {
            Self::refuse_read(b, "removed")?;
        }
        st.bitmaps.retain(|b| b.owner() != owner);
        Ok(self.commit(&mut st)?)
    }
}
