//! The engine handle: submit requests, read their events, shut down.

use super::engine_loop::{Command, EngineLoop};
use super::metrics::Metrics;
use super::scheduler::{Limits, Scheduler};
use super::sequence::Sequence;
use super::{EngineConfig, EngineInfo, Event, FinishReason, GenRequest, Usage};
use super::backend::{Backend, CpuBackend, CudaBackend, TpBackend};
use crate::device::Device;
use crate::kv_cache::{ExactKeyStore, KvCacheManager};
use crate::model::cuda::CudaLlama;
use crate::structured::{Grammars, Masker};
use crate::LoadedModel;
use tessera_kernels::cuda::CudaDevice;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a request was refused at submission (nothing was queued).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The waiting queue is full (HTTP 503 / 429).
    #[error("the server is overloaded: {waiting} requests are already waiting")]
    QueueFull {
        /// Requests waiting.
        waiting: usize,
    },
    /// A request with more sequences (prompts times choices) than the waiting queue holds:
    /// it could never be admitted, however idle the engine (HTTP 400).
    #[error("this request needs {choices} sequences (one per prompt and choice), more than the {max_waiting} the waiting queue holds (max_waiting_requests); ask for fewer choices or prompts per request")]
    TooManyChoices {
        /// Sequences the request needs.
        choices: usize,
        /// The waiting queue's capacity.
        max_waiting: usize,
    },
    /// Prompt plus `max_tokens` exceeds the context.
    #[error("This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt} in the prompt, {max_tokens} for the completion). Please reduce the length of the prompt or completion.", prompt.saturating_add(*max_tokens))]
    TooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A sampling parameter out of range.
    #[error("{msg}")]
    Invalid {
        /// The parameter's name.
        param: &'static str,
        /// What is wrong.
        msg: String,
    },
    /// The engine is shutting down or has stopped.
    #[error("the engine is shutting down")]
    ShuttingDown,
}

struct Inner {
    model: Arc<LoadedModel>,
    grammars: Result<Grammars, String>,
    info: EngineInfo,
    metrics: Arc<Metrics>,
    tx: Sender<Command>,
    accepting: AtomicBool,
    queued: Arc<AtomicUsize>,
    next_key: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A running engine (cheap to clone; all clones drive the same engine thread).
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Weight storage types of a plan, most common first.
fn quantization_summary(model: &LoadedModel) -> String {
    let mut counts = BTreeMap::new();
    for e in model.model.plan() {
        *counts.entry(e.storage.to_lowercase()).or_insert(0usize) += 1;
    }
    let mut v: Vec<(String, usize)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.into_iter().map(|(n, _)| n).collect::<Vec<_>>().join(",")
}

impl Engine {
    /// Sizes the KV-cache pool, starts the engine thread and returns its handle.
    pub fn start(model: Arc<LoadedModel>, config: EngineConfig) -> Result<Engine, String> {
        let c = &config;
        if c.max_num_seqs == 0 || c.block_size == 0 || c.max_waiting == 0 {
            return Err("max_num_seqs, block_size and max_waiting must be at least 1".into());
        }
        if c.max_num_batched_tokens <= c.max_num_seqs {
            return Err(format!(
                "max_num_batched_tokens ({}) must exceed max_num_seqs ({}): a prefill chunk of the difference runs beside one decode per sequence",
                c.max_num_batched_tokens, c.max_num_seqs
            ));
        }
        let mc = model.model.config();
        // One layout per tensor-parallel rank (its KV heads); a block id names a block in every
        // rank's pool, so the budget is shared by the ranks' blocks together.
        let layouts = model.kv_layouts(c.kv_dtype, c.block_size, c.kv_seed).map_err(|e| e.to_string())?;
        let layout = layouts[0].clone();
        let block_bytes: usize = layouts.iter().map(|l| l.block_bytes()).sum();
        let num_blocks = c.kv_cache_bytes / block_bytes;
        if num_blocks == 0 {
            return Err(format!("kv_cache_bytes {} holds no block of {block_bytes} bytes", c.kv_cache_bytes));
        }
        if layouts.len() > 1 && !matches!(c.device, Device::Cpu) {
            return Err("tensor parallelism runs on the CPU".into());
        }
        let max_model_len = c.max_model_len.unwrap_or(usize::MAX).min(mc.max_position_embeddings).min(num_blocks * c.block_size);
        let backend: Box<dyn Backend> = match c.device {
            Device::Cpu if layouts.len() > 1 => Box::new(TpBackend::new(model.clone(), &layouts, num_blocks)),
            Device::Cpu => Box::new(CpuBackend::new(model.clone(), layout.clone(), num_blocks)),
            Device::Cuda(ordinal) => {
                let dev = CudaDevice::open(ordinal).map_err(|e| e.to_string())?;
                tracing::info!(device = %dev.describe(), "CUDA device");
                let gpu = CudaLlama::load(&model.weights, dev, layout.clone(), num_blocks).map_err(|e| e.to_string())?;
                Box::new(CudaBackend::new(gpu))
            }
        };
        let info = EngineInfo {
            max_model_len,
            vocab_size: mc.vocab_size,
            kv_cache_type: layout.dtype().to_string(),
            kv_bytes_per_token: block_bytes as f64 / c.block_size as f64,
            block_size: c.block_size,
            num_blocks,
            quantization: quantization_summary(&model),
            quantization_config: model.weights.quantization.clone(),
            plan: backend.plan(),
            tensor_parallel_size: model.tensor_parallel_size(),
            config: config.clone(),
        };
        let model_name = model.weights.checkpoint.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let metrics = Arc::new(
            Metrics::new(&[("model", &model_name), ("quantization", &info.quantization), ("kv_cache_type", &info.kv_cache_type)], &info.plan, info.kv_bytes_per_token)
                .map_err(|e| format!("metrics: {e}"))?,
        );
        metrics.set_kv(0, num_blocks);
        let queued = Arc::new(AtomicUsize::new(0));
        let limits = Limits { max_seqs: c.max_num_seqs, max_tokens: c.max_num_batched_tokens, chunk: c.max_num_batched_tokens - c.max_num_seqs };
        let kv = KvCacheManager::new(num_blocks, c.block_size, c.prefix_caching).with_exact_keys(ExactKeyStore::for_layouts(layouts.iter().map(|l| &**l)));
        let sched = Scheduler::new(limits, kv, queued.clone());
        let (tx, rx) = channel();
        let engine_loop = EngineLoop {
            model: model.clone(),
            backend,
            sched,
            seqs: HashMap::new(),
            rx,
            metrics: metrics.clone(),
            max_model_len,
            deadline: None,
            masker: Masker::new(),
        };
        let thread = std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || engine_loop.run())
            .map_err(|e| format!("engine thread: {e}"))?;
        tracing::info!(kv_cache = %layout.describe(), num_blocks, block_bytes, ranks = layouts.len(), max_model_len, "KV-cache pool");
        let grammars = Grammars::new(&model.tokenizer, mc.vocab_size);
        if let Err(e) = &grammars {
            tracing::warn!("structured outputs are disabled: {e}");
        }
        Ok(Engine {
            inner: Arc::new(Inner {
                grammars,
                model,
                info,
                metrics,
                tx,
                accepting: AtomicBool::new(true),
                queued,
                next_key: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// What the engine serves.
    pub fn info(&self) -> &EngineInfo {
        &self.inner.info
    }

    /// The model (tokenizer, chat template, special tokens).
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.inner.model
    }

    /// The structured-output compiler for the model's vocabulary (built at start), or why
    /// there is none.
    pub fn grammars(&self) -> Result<&Grammars, &str> {
        self.inner.grammars.as_ref().map_err(String::as_str)
    }

    /// Whether the engine thread is alive (false after shutdown or if it died).
    pub fn is_running(&self) -> bool {
        let thread = self.inner.thread.lock().unwrap_or_else(|e| e.into_inner());
        thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The Prometheus registry holding the engine's `tessera_*` metrics.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.inner.metrics.registry
    }

    /// Checks a request against the engine's limits: the one place every caller's request
    /// (server, CLI, perplexity) is range-checked before anything is queued.
    fn validate(&self, req: &GenRequest) -> Result<(), SubmitError> {
        let info = &self.inner.info;
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&id) = req.prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(SubmitError::TokenOutOfRange { id, vocab: info.vocab_size });
        }
        req.sampling.validate().map_err(|(param, msg)| SubmitError::Invalid { param, msg })?;
        if req.min_tokens > req.max_tokens {
            let msg = format!("min_tokens ({}) must be less than or equal to max_tokens ({})", req.min_tokens, req.max_tokens);
            return Err(SubmitError::Invalid { param: "min_tokens", msg });
        }
        if req.prompt_logprobs.is_some_and(|n| n > 20) {
            return Err(SubmitError::Invalid { param: "logprobs", msg: "logprobs must be in [0, 20]".into() });
        }
        if req.prompt.len().saturating_add(req.max_tokens) > info.max_model_len {
            return Err(SubmitError::TooLong { prompt: req.prompt.len(), max_tokens: req.max_tokens, max_model_len: info.max_model_len });
        }
        Ok(())
    }

    /// Queues a request; its events arrive on the returned stream.
    pub fn submit(&self, req: GenRequest) -> Result<RequestStream, SubmitError> {
        Ok(self.submit_all(vec![req])?.swap_remove(0))
    }

    /// Queues the sequences of one client request (every prompt's choices) all at once, or
    /// none of them; their events arrive on the returned streams, in order. Requests with the
    /// same prompt and prompt logprobs share one prefill: the first computes the prompt and
    /// the others fork from it (sharing its KV blocks) to sample their own continuations.
    pub fn submit_all(&self, reqs: Vec<GenRequest>) -> Result<Vec<RequestStream>, SubmitError> {
        let inner = &self.inner;
        if !inner.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        for req in &reqs {
            self.validate(req)?;
        }
        // Requests that only count their prompt need no engine work and no queue slot.
        let trivial = |r: &GenRequest| r.max_tokens == 0 && r.prompt_logprobs.is_none();
        let queued = reqs.iter().filter(|r| !trivial(r)).count();
        let cap = inner.info.config.max_waiting;
        if queued > cap {
            return Err(SubmitError::TooManyChoices { choices: queued, max_waiting: cap });
        }
        if queued > 0 {
            inner
                .queued
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| (q + queued <= cap).then_some(q + queued))
                .map_err(|waiting| SubmitError::QueueFull { waiting })?;
        }
        let mut streams = Vec::with_capacity(reqs.len());
        let mut groups: Vec<(Sequence, Vec<Sequence>)> = Vec::new();
        let mut by_prompt: HashMap<(Vec<u32>, Option<usize>, usize), usize> = HashMap::new();
        for req in reqs {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let key = inner.next_key.fetch_add(1, Ordering::Relaxed);
            streams.push(RequestStream { rx, key, engine: inner.tx.clone(), done: false });
            if trivial(&req) {
                // Nothing to compute.
                let usage = Usage { prompt_tokens: req.prompt.len(), completion_tokens: 0, cached_tokens: 0 };
                let _ = tx.send(Event::Finished { reason: FinishReason::Length, stop_reason: None, usage });
                continue;
            }
            let seq = Sequence::new(key, req, tx);
            match by_prompt.entry((seq.req.prompt.clone(), seq.req.prompt_logprobs, seq.req.score_from)) {
                Entry::Occupied(e) => groups[*e.get()].1.push(seq),
                Entry::Vacant(e) => {
                    e.insert(groups.len());
                    groups.push((seq, Vec::new()));
                }
            }
        }
        if queued > 0 && inner.tx.send(Command::Submit(groups)).is_err() {
            inner.queued.fetch_sub(queued, Ordering::AcqRel);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(streams)
    }

    /// Stops admitting requests, lets running ones finish for up to `grace`, aborts the rest
    /// (their streams get `Finished { reason: Abort }`), and stops the engine thread.
    /// Blocks until the thread has exited; later calls return at once.
    pub fn shutdown(&self, grace: Duration) {
        self.inner.accepting.store(false, Ordering::Release);
        let _ = self.inner.tx.send(Command::Shutdown(Instant::now() + grace));
        let thread = self.inner.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// The events of one request. Dropping it before the request finished aborts the request
/// (its KV blocks are freed within one engine step).
pub struct RequestStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    key: u64,
    engine: Sender<Command>,
    done: bool,
}

impl RequestStream {
    fn seen(&mut self, e: Option<Event>) -> Option<Event> {
        if matches!(e, None | Some(Event::Finished { .. } | Event::Error(_))) {
            self.done = true;
        }
        e
    }

    /// The next event; `None` after `Finished`/`Error`.
    pub async fn next(&mut self) -> Option<Event> {
        let e = self.rx.recv().await;
        self.seen(e)
    }

    /// The next event, blocking the calling (non-async) thread.
    pub fn blocking_next(&mut self) -> Option<Event> {
        let e = self.rx.blocking_recv();
        self.seen(e)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.engine.send(Command::Abort(self.key));
        }
    }
}
