//! Hugging Face directory loading: the default model's first two layers exported as a sharded
//! safetensors checkpoint (F32 linears, F16 embedding, BF16 norms) with config.json,
//! tokenizer.json and tokenizer_config.json, loaded back and run against the GGUF model cut to
//! the same two layers; malformed directories failing with the name of what is wrong; and a
//! `kv_cache_scheme` with per-layer k_scale / v_scale choosing the KV cache.

use crate::common;

use common::default_model_path;
use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use tessera_engine::checkpoint::{Checkpoint, TensorEntry};
use tessera_engine::kv_cache::{KvCacheScheme, KvDtype, KvRequest};
use tessera_engine::model::{LlamaModel, SeqInput};
use tessera_engine::sample::argmax;
use tessera_engine::tokenizer::Tokenizer;
use tessera_engine::weights::ModelWeights;
use tessera_kernels::cpu::CpuCaps;
use tessera_kernels::ggml::dequantize_row;
use tessera_kernels::kv::KvFormat;
use tessera_kernels::linear::LinearPolicy;

const LAYERS: usize = 2;

fn floats(t: &TensorEntry) -> Vec<f32> {
    let n: usize = t.shape.iter().product();
    let mut out = vec![0f32; n];
    dequantize_row(t.ty, t.data.bytes(), &mut out);
    out
}

fn encode(v: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

fn hf_name(canon: &str) -> Option<String> {
    Some(match canon {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        _ => {
            let rest = canon.strip_prefix("blk.")?;
            let (i, s) = rest.split_once('.')?;
            if i.parse::<usize>().ok()? >= LAYERS {
                return None;
            }
            let suffix = match s {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                _ => return None,
            };
            format!("model.layers.{i}.{suffix}")
        }
    })
}

/// One exported tensor: HF name, dtype, shape, bytes.
type Exported = (String, Dtype, Vec<usize>, Vec<u8>);

/// Writes the export; returns the GGUF checkpoint cut to `LAYERS` layers.
fn export(dir: &Path) -> Checkpoint {
    let mut ck = ModelWeights::open(&default_model_path()).unwrap().checkpoint;
    ck.config.num_layers = LAYERS;
    let c = &ck.config;
    let mut shards: [Vec<Exported>; 2] = [Vec::new(), Vec::new()];
    for (canon, t) in &ck.tensors {
        let Some(name) = hf_name(canon) else { continue };
        let dtype = if canon == "token_embd.weight" {
            Dtype::F16
        } else if t.shape.len() == 1 {
            Dtype::BF16
        } else {
            Dtype::F32
        };
        let shard = usize::from(name.contains("layers.1."));
        shards[shard].push((name, dtype, t.shape.clone(), encode(&floats(t), dtype)));
    }
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", i + 1);
        let views: Vec<(String, TensorView<'_>)> =
            shard.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, &None, &dir.join(&file)).unwrap();
        for (n, ..) in shard {
            weight_map.insert(n.clone(), file.clone());
        }
    }
    let write = |name: &str, v: serde_json::Value| std::fs::write(dir.join(name), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    write("model.safetensors.index.json", json!({ "metadata": {}, "weight_map": weight_map }));
    write(
        "config.json",
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": LAYERS, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
            "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": true, "rope_scaling": null, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2
        }),
    );
    write(
        "tokenizer_config.json",
        json!({ "add_bos_token": false, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": "{{ messages }}" }),
    );
    write("generation_config.json", json!({ "eos_token_id": [2] }));
    Tokenizer::from_checkpoint(&ck).unwrap().inner().save(dir.join("tokenizer.json"), false).unwrap();
    ck
}

fn logits(m: &LlamaModel, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.local_kv(512);
    m.forward(&mut [SeqInput { tokens, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0)
}

#[test]
fn hf_directory_runs_like_the_gguf_it_came_from() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = ModelWeights::from(export(dir.path()));
    let hf = ModelWeights::open(dir.path()).unwrap();
    let (gguf_ck, hf_ck) = (&gguf.checkpoint, &hf.checkpoint);
    assert_eq!(hf_ck.config, gguf_ck.config);
    assert_eq!(hf_ck.special.eos, vec![2], "eos from generation_config.json (and <|im_end|> is id 2)");
    assert_eq!(hf_ck.special.bos, Some(1));
    assert!(!hf_ck.special.add_bos);
    assert_eq!(hf_ck.special.chat_template.as_deref(), Some("{{ messages }}"));
    assert_eq!(hf_ck.tensors["blk.1.ffn_down.weight"].source_name, "model.layers.1.mlp.down_proj.weight");

    let text = "It is a truth universally acknowledged, that a single man";
    let (tg, th) = (Tokenizer::from_checkpoint(gguf_ck).unwrap(), Tokenizer::from_checkpoint(hf_ck).unwrap());
    let tokens = tg.encode(text).unwrap();
    assert_eq!(th.encode(text).unwrap(), tokens, "tokenizer.json round trip");

    let caps = CpuCaps::detect();
    let a = logits(&LlamaModel::load(&gguf, &caps, LinearPolicy::ALWAYS_GEMM).unwrap(), &tokens);
    let b = logits(&LlamaModel::load(&hf, &caps, LinearPolicy::ALWAYS_GEMM).unwrap(), &tokens);
    // Only the F16 embedding and BF16 norms round the weights (2^-11 and 2^-8 relative);
    // measured max |diff| <= 3e-4 of the logit spread, bound 1e-2.
    let vocab = gguf_ck.config.vocab_size;
    for (ra, rb) in a.chunks(vocab).zip(b.chunks(vocab)) {
        let spread = ra.iter().cloned().fold(f32::MIN, f32::max) - ra.iter().cloned().fold(f32::MAX, f32::min);
        let err = ra.iter().zip(rb).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max) / spread;
        eprintln!("hf vs gguf: max |diff| / spread = {err:.2e}");
        assert!(err < 1e-2, "relative error {err}");
        assert_eq!(argmax(ra), argmax(rb));
    }
}

#[test]
fn malformed_directories_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    export(dir.path());
    let cfg_path = dir.path().join("config.json");
    let good_cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let with_cfg = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut c = good_cfg.clone();
        f(&mut c);
        std::fs::write(&cfg_path, c.to_string()).unwrap();
        ModelWeights::open(dir.path()).err().map(|e| e.to_string()).unwrap_or_default()
    };
    // Metadata that says quantized over plain weights: the first quantized layer is named.
    assert!(with_cfg(&|c| c["quantization_config"] = json!({"quant_method": "gptq"})).contains("qweight: missing: quant_method gptq quantizes this layer"));
    assert!(with_cfg(&|c| c["quantization_config"] = json!({"quant_method": "bitsandbytes"})).contains("quantization_config.quant_method"));
    assert!(with_cfg(&|c| c["model_type"] = json!("gpt_neox")).contains("unsupported architecture \"gpt_neox\""));
    assert!(with_cfg(&|c| c["model_type"] = json!("qwen3_moe")).contains("num_experts: missing"));
    let mla = with_cfg(&|c| {
        c["model_type"] = json!("deepseek_v3");
        c["kv_lora_rank"] = json!(512);
    });
    assert!(mla.contains("kv_lora_rank") && mla.contains("(MLA) is not supported"), "{mla}");
    assert!(with_cfg(&|c| c.as_object_mut().unwrap().remove("hidden_size").map(|_| ()).unwrap()).contains("hidden_size"));
    assert!(with_cfg(&|c| c["num_key_value_heads"] = json!(4)).contains("num_kv_heads"));
    assert!(with_cfg(&|c| c["rope_scaling"] = json!({"type": "yarn"})).contains("rope_scaling"));
    // A layer count beyond the exported tensors: the missing tensor is named at model load.
    with_cfg(&|c| c["num_hidden_layers"] = json!(3));
    let ck = ModelWeights::open(dir.path()).unwrap();
    let e = LlamaModel::load(&ck, &CpuCaps::detect(), LinearPolicy::DEFAULT).err().unwrap().to_string();
    assert!(e.starts_with("tensor blk.2.") && e.contains("missing"), "{e}");
    std::fs::write(&cfg_path, good_cfg.to_string()).unwrap();

    // An integer tensor in a plain checkpoint, and an unknown tensor name.
    let bad = dir.path().join("model-00002-of-00002.safetensors");
    let bytes = vec![1u8; 16];
    let views = vec![("model.layers.1.mlp.up_proj.weight".to_string(), TensorView::new(Dtype::I8, vec![4, 4], &bytes).unwrap())];
    safetensors::serialize_to_file(views, &None, &bad).unwrap();
    let e = ModelWeights::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("I8"), "{e}");
    let views = vec![("model.layers.1.mlp.experts.0.w1".to_string(), TensorView::new(Dtype::F32, vec![2, 2], &bytes).unwrap())];
    safetensors::serialize_to_file(views, &None, &bad).unwrap();
    let e = ModelWeights::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("model.layers.1.mlp.experts.0.w1") && e.contains("not a tensor name of a supported architecture"), "{e}");
    std::fs::write(&bad, b"not safetensors").unwrap();
    assert!(ModelWeights::open(dir.path()).unwrap_err().to_string().contains("invalid safetensors"));
}

/// Adds `tensors` (scalar f32 scales by name) as one more shard of the export in `dir`.
fn add_scale_shard(dir: &Path, tensors: &[(String, f32)]) {
    let file = "kv-scales.safetensors";
    let bytes: Vec<[u8; 4]> = tensors.iter().map(|(_, v)| v.to_le_bytes()).collect();
    let views: Vec<(String, TensorView<'_>)> = tensors.iter().zip(&bytes).map(|((n, _), b)| (n.clone(), TensorView::new(Dtype::F32, vec![], b).unwrap())).collect();
    safetensors::serialize_to_file(views, &None, &dir.join(file)).unwrap();
    let index = dir.join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    for (n, _) in tensors {
        v["weight_map"][n] = json!(file);
    }
    std::fs::write(index, v.to_string()).unwrap();
}

#[test]
fn kv_cache_scheme_scales_choose_the_cache_format() {
    let dir = tempfile::tempdir().unwrap();
    export(dir.path());
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["quantization_config"] = json!({
        "quant_method": "compressed-tensors", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false, "symmetric": true}
    });
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let scales = [(0.031, 0.017), (0.045, 0.012)];
    // Layer 0 in the current names, layer 1 in the older `*_proj.output_scale` ones.
    let names = |i: usize, side: &str| if i == 0 { format!("model.layers.0.self_attn.{side}_scale") } else { format!("model.layers.{i}.self_attn.{side}_proj.output_scale") };
    let tensors: Vec<(String, f32)> = scales.iter().enumerate().flat_map(|(i, &(k, v))| [(names(i, "k"), k), (names(i, "v"), v)]).collect();
    add_scale_shard(dir.path(), &tensors);

    let ck = ModelWeights::open(dir.path()).unwrap();
    assert_eq!(ck.kv_cache, Some(KvCacheScheme { format: KvFormat::FP8_E4M3, scales: scales.to_vec() }));
    let m = LlamaModel::load(&ck, &CpuCaps::detect(), LinearPolicy::DEFAULT).unwrap();
    // auto takes the checkpoint's format with its static scales: one byte per element, no stored scale.
    let auto = m.kv_layout(KvRequest::default(), 16, 0).unwrap();
    assert_eq!(auto.dtype(), KvDtype::both(KvFormat::FP8_E4M3));
    assert_eq!(auto.codecs(1).0.name(), "fp8_e4m3 (static scale)");
    assert_eq!(auto.static_scales(1), (Some(0.045), Some(0.012)));
    let c = &ck.checkpoint.config;
    assert_eq!(auto.bytes_per_token(), (LAYERS * 2 * c.num_kv_heads * c.head_dim) as f64);
    // An explicit format wins; only a side in the checkpoint's format uses its scales.
    let mixed = m.kv_layout(KvRequest { k: Some(KvFormat::FP8_E4M3), v: Some(KvFormat::INT8) }, 16, 0).unwrap();
    assert_eq!((mixed.codecs(0).0.name(), mixed.codecs(0).1.name()), ("fp8_e4m3 (static scale)".into(), "int8".into()));
    assert_eq!(mixed.static_scales(0), (Some(0.031), None));
    // The static cache runs: its logits stay near the f32 cache's (these scales keep K and V of
    // these two layers inside E4M3's range). E4M3 rounds each element by up to 2^-4 relative;
    // over two layers this measured 8e-3 of the logit spread; bound 0.1, and not 0 (the scales
    // are used).
    let tokens = Tokenizer::from_checkpoint(&ck.checkpoint).unwrap().encode("It is a truth universally acknowledged").unwrap();
    let run = |layout| {
        let mut kv = tessera_engine::kv_cache::LocalKv::new(layout, 64);
        m.forward(&mut [SeqInput { tokens: &tokens, kv: &mut kv, logits_from: Some(0) }]).unwrap().swap_remove(0)
    };
    let (f32_logits, fp8_logits) = (run(m.kv_layout(KvDtype::both(KvFormat::F32), 16, 0).unwrap()), run(auto));
    let err = common::max_rel_err(&fp8_logits, &f32_logits, c.vocab_size);
    eprintln!("static fp8 KV vs f32 KV: max |diff| / spread = {err:.2e}");
    assert!(err > 0.0 && err < 0.1, "{err}");

    // A missing, zero or non-scalar scale names the tensor.
    let broken = |tensors: &[(String, f32)]| {
        add_scale_shard(dir.path(), tensors);
        ModelWeights::open(dir.path()).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let e = broken(&tensors[..3]);
    assert!(e.contains("model.layers.1.self_attn.v_scale") && e.contains("kv_cache_scheme"), "{e}");
    let mut zero = tensors.clone();
    zero[2].1 = 0.0;
    let e = broken(&zero);
    assert!(e.contains("model.layers.1.self_attn.k_proj.output_scale") && e.contains("finite and positive"), "{e}");
}
