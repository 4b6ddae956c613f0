//! A thread that computes the structured outputs' masks beside the forward pass: the engine
//! hands it the guides of the sequences that sample after the step, runs the pass, then takes
//! the guides back with their masks. One thread for the engine's life (spawning one per step
//! cost about 30 µs a step).

use super::{Guide, TokenSet};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

/// Guides by sequence key.
pub type Guides = Vec<(u64, Guide)>;
/// Each guide's mask, in the guides' order (an `Err` is the guide's failure).
pub type Masks = Vec<Result<TokenSet, String>>;

/// The mask thread. Dropping it stops the thread.
pub struct Masker {
    jobs: Option<Sender<Guides>>,
    done: Receiver<(Guides, Masks)>,
    thread: Option<JoinHandle<()>>,
    /// Guides handed out and not yet taken back.
    busy: bool,
}

impl Masker {
    /// Starts the thread.
    pub fn new() -> Masker {
        let (jobs, inbox) = channel::<Guides>();
        let (outbox, done) = channel();
        let thread = std::thread::Builder::new()
            .name("tessera-masks".into())
            .spawn(move || {
                for mut guides in inbox {
                    let masks = guides.iter_mut().map(|(_, g)| g.allowed()).collect();
                    if outbox.send((guides, masks)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning the structured-output mask thread");
        Masker { jobs: Some(jobs), done, thread: Some(thread), busy: false }
    }

    /// Starts computing the masks of `guides` (nothing to do when empty).
    pub fn start(&mut self, guides: Guides) {
        assert!(!self.busy, "the previous masks were not taken");
        if guides.is_empty() {
            return;
        }
        self.jobs.as_ref().expect("the mask thread runs").send(guides).expect("the mask thread runs");
        self.busy = true;
    }

    /// Waits for the masks started last; the guides come back in the order they went.
    pub fn wait(&mut self) -> (Guides, Masks) {
        if !std::mem::take(&mut self.busy) {
            return (Vec::new(), Vec::new());
        }
        self.done.recv().expect("the mask thread does not panic")
    }
}

impl Default for Masker {
    fn default() -> Self {
        Masker::new()
    }
}

impl Drop for Masker {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
