//! Entry points of the engine's fuzz targets (`fuzz/fuzz_targets/`), also run over the stored
//! corpora by the replay tests (`tests/it/fuzz_corpus.rs`) in the ordinary test suite.
//!
//! Each takes arbitrary bytes and must return (an error is a fine answer) without panicking,
//! hanging or allocating without bound.

use crate::checkpoint::gguf::GgufFile;
use crate::checkpoint::{gguf_from_file, LoadError};
use crate::model::LlamaModel;
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::weights::ModelWeights;
use memmap2::MmapMut;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::linear::LinearPolicy;

/// GGUF bytes through the whole GGUF load: container, hyper-parameters, tensors (Q/K rows
/// un-permuted, stacked experts split), the tokenizer built from the vocabulary, and the model
/// built from the tensors.
pub fn gguf(data: &[u8]) -> Result<(), LoadError> {
    let path = Path::new("fuzz.gguf");
    let io = |e: std::io::Error| LoadError::Io { path: path.into(), msg: e.to_string() };
    let mut map = MmapMut::map_anon(data.len()).map_err(io)?;
    map.copy_from_slice(data);
    let map = map.make_read_only().map_err(io)?;
    let f = GgufFile::parse(Arc::new(map)).map_err(|error| LoadError::Gguf { path: path.into(), error })?;
    let ckpt = gguf_from_file(f, path)?;
    use_checkpoint(&ckpt.into())
}

/// A Hugging Face directory through [`ModelWeights::open`]: the input is
/// `config.json NUL tokenizer_config.json NUL model.safetensors` (JSON holds no raw NUL; a
/// missing part is an empty file, except tokenizer_config.json, which is then absent). The
/// directory also holds a small fixed tokenizer.json.
pub fn hf_checkpoint(data: &[u8]) -> Result<(), LoadError> {
    let (config, rest) = split_nul(data);
    let (tokenizer_config, safetensors) = split_nul(rest.unwrap_or_default());
    let dir = scratch_dir("hf");
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.join(name);
        std::fs::write(&p, bytes).map_err(|e| LoadError::Io { path: p, msg: e.to_string() })
    };
    write("config.json", config)?;
    write("model.safetensors", safetensors.unwrap_or_default())?;
    if !dir.join("tokenizer.json").exists() {
        write("tokenizer.json", TOKENIZER_JSON.as_bytes())?;
    }
    let tcfg = dir.join("tokenizer_config.json");
    match rest {
        Some(_) => write("tokenizer_config.json", tokenizer_config)?,
        None => {
            let _ = std::fs::remove_file(&tcfg);
        }
    }
    let weights = ModelWeights::open(&dir)?;
    use_checkpoint(&weights)
}

/// Token ids through [`Tokenizer::decode`] and the streaming [`IncrementalDecoder`]: the input
/// is little-endian u16 ids (`0xffff` stands for `u32::MAX`, an id far out of range). When the
/// whole decode is clean UTF-8 text (no U+FFFD), the streamed pieces must add up to it.
pub fn tokenizer_decode(tok: &Tokenizer, data: &[u8]) {
    let ids: Vec<u32> = data
        .chunks_exact(2)
        .map(|c| match u16::from_le_bytes([c[0], c[1]]) {
            u16::MAX => u32::MAX,
            id => u32::from(id),
        })
        .collect();
    let whole = tok.decode(&ids);
    let mut dec = IncrementalDecoder::new();
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&dec.push(tok, id));
    }
    streamed.push_str(&dec.flush(tok));
    if !whole.contains('\u{FFFD}') {
        assert_eq!(streamed, whole, "streamed text differs from the whole decode of {ids:?}");
    }
    for &id in ids.iter().take(16) {
        let _ = tok.id_to_token(id);
    }
}

/// The default model's tokenizer ([`crate::default_model::for_tests`]), built once.
pub fn default_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let weights = ModelWeights::open(&crate::default_model::for_tests()).expect("the default model loads");
        Tokenizer::from_checkpoint(&weights.checkpoint).expect("the default model's tokenizer builds")
    })
}

/// The default model's tokenizer with `texts` added as special tokens (ids after the
/// vocabulary's): for tests of syntaxes whose markers are special tokens in other models.
pub fn default_tokenizer_with_special(texts: &[&str]) -> Tokenizer {
    let mut tok = default_tokenizer().clone();
    tok.add_special_tokens(texts);
    tok
}

/// What a server does with a checkpoint after reading it: touch every tensor, build the
/// tokenizer and decode a few ids, build the model.
fn use_checkpoint(weights: &ModelWeights) -> Result<(), LoadError> {
    let ckpt = &weights.checkpoint;
    for t in ckpt.tensors.values() {
        std::hint::black_box((t.data.bytes().len(), t.matrix_dims()));
    }
    let tok = Tokenizer::from_checkpoint(ckpt)?;
    let n = u32::try_from(tok.vocab_size()).unwrap_or(u32::MAX);
    std::hint::black_box(tok.decode(&[0, 1, n.saturating_sub(1), n, u32::MAX]));
    let _ = tok.encode("Hello, world! 123 <|im_start|>");
    static CAPS: OnceLock<CpuCaps> = OnceLock::new();
    LlamaModel::load(weights, CAPS.get_or_init(CpuCaps::detect), LinearPolicy::DEFAULT)?;
    Ok(())
}

/// `(before the first NUL, after it)`.
fn split_nul(data: &[u8]) -> (&[u8], Option<&[u8]>) {
    match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    }
}

/// A directory of this thread's own, created once per thread: in /dev/shm where it exists
/// (creating files on a disk-backed /tmp takes milliseconds and slowed the fuzzer 50-fold),
/// else under the temporary directory.
fn scratch_dir(what: &str) -> PathBuf {
    /// Removes the directory when its thread ends.
    struct Scratch(PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static DIR: Scratch = {
            let shm = Path::new("/dev/shm");
            let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
            let d = base.join(format!("tessera-fuzz-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
            std::fs::create_dir_all(&d).expect("temporary directory");
            Scratch(d)
        };
    }
    let d = DIR.with(|d| d.0.join(what));
    std::fs::create_dir_all(&d).expect("temporary directory");
    d
}

/// A tiny byte-level BPE tokenizer.json for the Hugging Face target's directory.
const TOKENIZER_JSON: &str = r#"{"version":"1.0","truncation":null,"padding":null,
"added_tokens":[{"id":4,"content":"<|im_end|>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
"normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true},
"post_processor":null,"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},
"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,
"vocab":{"a":0,"b":1,"ab":2,"Ġ":3,"<|im_end|>":4},"merges":["a b"]}}"#;

/// Runs `f` on every stored input of fuzz target `target` (the files of the workspace's
/// `fuzz/corpus/<target>/` and `fuzz/regressions/<target>/`, in name order), catching panics.
/// Returns how many inputs ran, or an error naming each input that panicked (or saying that
/// there were none to run). The replay tests of every crate share it.
pub fn replay_corpus(target: &str, f: impl Fn(&[u8])) -> Result<usize, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let mut inputs = 0;
    let mut failed = Vec::new();
    for dir in ["corpus", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            let data = std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            inputs += 1;
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&data))).is_err() {
                failed.push(p.display().to_string());
            }
        }
    }
    match (inputs, failed.is_empty()) {
        (0, _) => Err(format!("no stored inputs for {target}")),
        (_, true) => Ok(inputs),
        _ => Err(format!("{} of {inputs} {target} inputs panicked: {failed:?}", failed.len())),
    }
}
