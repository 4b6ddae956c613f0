//! A rotated residual stream for `tessera quantize --rotate` (QuaRot's and SpinQuant's R1:
//! Ashkboos et al. 2024, Liu et al. 2024). Every RMSNorm weight folds into the linears that
//! read the norm's output and becomes 1; then an orthogonal `Q` folds into every weight that
//! reads or writes the residual stream: the embedding `E Q`; Q/K/V and gate/up
//! `W diag(w_norm) Q`; O and down `Qᵀ W`; the output head `H diag(w_final) Q`, written untied.
//! RMS norms commute with `Q` once their weights are 1, so the model computes the same
//! function (up to rounding), while each linear row's outliers spread over all its columns,
//! which one int4 scale per row (W4A8's per-channel recipe) needs.
//!
//! `Q` is random (Gaussian columns made orthonormal by Gram-Schmidt, twice, in f64: about
//! `4 n³` operations on one thread, seconds at hidden size 2048) from a seed. Dense models of
//! the [`ROTATABLE`] architectures only: no biases on the residual's writers, no MoE.
//!
//! R2 as well, offline: each attention head's values are rotated by a Sylvester Hadamard
//! matrix `Hd` of the head's order (`Hd W_v` per head's rows), and O reads them back
//! (`W_o Hd` per head's columns); attention mixes values per head linearly, so the function
//! stays, and O's input (the attention output) has its outliers spread within each head.
//! Heads of a power-of-two order only (others keep R1 alone).
//!
//! With [`Online::DownHadamard`], SpinQuant's R4 as well: `down_proj`'s input (the SwiGLU
//! product, whose outliers R1 cannot reach) is multiplied at run time by a Sylvester Hadamard
//! matrix `H` in blocks ([`down_block`]), and `W H` is folded into down's weights. The model
//! then needs the online transform to compute the same function: config.json gets a
//! compressed-tensors `quantization_config` holding only its `transform_config` (group `R4`,
//! `hadamard`, `head_dim` the block, online at `input` and folded at `weight_input`), which
//! Tessera's loader runs (`schemes::transform`) and `quantize_dir` carries into a
//! compressed-tensors output.

use super::{copy_model_files, float_weights, input_shards, io, map_file, read_json, read_shard, write_json, write_tensors, OutTensor, QuantizeError};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::Path;
use tessera_kernels::ops::BlockTransform;

/// Online rotations besides R1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Online {
    /// None: the rotated model is a plain float model.
    None,
    /// SpinQuant's R4: a blocked Hadamard before every `down_proj`.
    DownHadamard,
}

/// The Hadamard block for a feed-forward of inner width `ffn` (not 0): its largest
/// power-of-two divisor (the whole width when it is a power of two; 512 for 1536).
fn down_block(ffn: usize) -> usize {
    1 << ffn.trailing_zeros()
}

/// The compressed-tensors `transform_config` of R4 in blocks of `block`.
fn down_transform_config(block: usize) -> Value {
    let targets = json!(["re:.*mlp.down_proj$"]);
    json!({ "config_groups": { "R4": {
        "type": "hadamard",
        "head_dim": block,
        "randomize": false,
        "requires_grad": false,
        "precision": "torch.float32",
        "apply": [
            { "targets": targets, "location": "input", "inverse": false, "ignore": [] },
            { "targets": targets, "location": "weight_input", "inverse": true, "ignore": [] },
        ],
    } } })
}

/// Architectures whose blocks are pre-norm RMSNorm (`x · w`) around Q/K/V/O and gate/up/down.
const ROTATABLE: &[&str] = &["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"];

/// A random `n x n` orthogonal matrix (row-major) from `seed`.
pub fn random_orthogonal(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // Box-Muller: Gaussian entries make the orthonormalized columns uniformly distributed.
    let mut gauss = || {
        let (u, v): (f64, f64) = (1.0 - rng.gen::<f64>(), rng.gen());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    };
    // Columns as rows of `c` while orthonormalizing.
    let mut c: Vec<Vec<f64>> = (0..n).map(|_| (0..n).map(|_| gauss()).collect()).collect();
    for j in 0..n {
        let (done, rest) = c.split_at_mut(j);
        let v = &mut rest[0];
        for _ in 0..2 {
            for u in done.iter() {
                let d: f64 = u.iter().zip(v.iter()).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(u).for_each(|(x, a)| *x -= d * a);
            }
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter_mut().for_each(|x| *x /= norm);
    }
    // Q[i][j] = column j's entry i.
    (0..n * n).map(|k| c[k % n][k / n]).collect()
}

/// How a tensor is rotated.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    /// Reads the residual stream after this norm (of a block, or `None`: the final norm):
    /// `W diag(w) Q`.
    Reads(Option<(usize, NormKind)>),
    /// Writes the residual stream: `Qᵀ W`.
    Writes,
    /// The embedding: `E Q`.
    Embedding,
    /// A norm weight: becomes 1.
    Norm,
    /// Q/K/V biases: they act after the residual rotation is undone, and stay as they are
    /// (V's turns with R2's per-head rotation).
    Kept,
}

/// Which norm of a block a reader follows.
#[derive(Clone, Copy, Debug, PartialEq)]
enum NormKind {
    /// `input_layernorm` (Q/K/V).
    Attention,
    /// `post_attention_layernorm` (gate/up).
    Mlp,
}

/// The role of the tensor `name` (Hugging Face Llama names), or an error for tensors the
/// rotation does not know how to carry.
fn role(name: &str) -> Result<Role, String> {
    if name == "model.embed_tokens.weight" {
        return Ok(Role::Embedding);
    }
    if name == "model.norm.weight" {
        return Ok(Role::Norm);
    }
    if name == "lm_head.weight" {
        return Ok(Role::Reads(None));
    }
    let rest = name.strip_prefix("model.layers.").ok_or("not a Llama-family tensor the rotation knows")?;
    let (layer, module) = rest.split_once('.').ok_or("not a Llama-family tensor the rotation knows")?;
    let layer: usize = layer.parse().map_err(|_| "not a Llama-family tensor the rotation knows")?;
    Ok(match module {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => Role::Norm,
        "self_attn.q_proj.weight" | "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => Role::Reads(Some((layer, NormKind::Attention))),
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => Role::Reads(Some((layer, NormKind::Mlp))),
        "self_attn.o_proj.weight" | "mlp.down_proj.weight" => Role::Writes,
        // A bias on O or down would be rotated too; none is expected, so it is refused.
        "self_attn.q_proj.bias" | "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => Role::Kept,
        _ => return Err("not a Llama-family tensor the rotation knows (biases on the residual's writers, MoE and other layers are not rotated)".into()),
    })
}

/// The rotations applied to each tensor, and where the norms they fold are read.
struct Rotation<'a> {
    /// R1 (`hidden x hidden`, row-major f64).
    q: Vec<f64>,
    hidden: usize,
    /// R2: per head of the values.
    r2: Option<BlockTransform>,
    /// R4: down_proj's input.
    r4: Option<BlockTransform>,
    /// Every input shard's tensors.
    shards: &'a [SafeTensors<'a>],
}

/// Rows (or columns) rotated per product: bounds the f64 temporaries of one tensor.
const CHUNK: usize = 1024;

impl Rotation<'_> {
    /// The norm weight `name` (a vector of the hidden size), from whichever shard holds it.
    fn norm(&self, name: &str) -> Result<Vec<f64>, QuantizeError> {
        let missing = || QuantizeError::Tensor { name: name.into(), msg: "missing (the rotation folds it)".into() };
        let view = self.shards.iter().find_map(|s| s.tensor(name).ok()).ok_or_else(missing)?;
        if view.shape() != [self.hidden] {
            return Err(QuantizeError::Tensor { name: name.into(), msg: format!("shape {:?}, expected [{}]", view.shape(), self.hidden) });
        }
        Ok(float_weights(name, &view)?.1.iter().map(|&x| f64::from(x)).collect())
    }

    /// The tensor `view` rotated for its role as `name`, in its input dtype.
    fn tensor(&self, name: &str, view: &TensorView<'_>) -> Result<OutTensor<'static>, QuantizeError> {
        let bad = |msg: String| QuantizeError::Tensor { name: name.into(), msg };
        let role = role(name).map_err(|m| bad(m.to_string()))?;
        let (dtype, w) = float_weights(name, view)?;
        let shape = view.shape().to_vec();
        let hidden = self.hidden;
        let mut f: Vec<f32> = match role {
            Role::Kept => w,
            Role::Norm => vec![1.0; w.len()],
            Role::Embedding | Role::Reads(..) => {
                let [_, cols] = shape[..] else { return Err(bad(format!("shape {shape:?} is not a matrix"))) };
                if cols != hidden {
                    return Err(bad(format!("{cols} columns, expected the hidden size {hidden}")));
                }
                let scale = match role {
                    Role::Reads(Some((l, NormKind::Attention))) => Some(self.norm(&format!("model.layers.{l}.input_layernorm.weight"))?),
                    Role::Reads(Some((l, NormKind::Mlp))) => Some(self.norm(&format!("model.layers.{l}.post_attention_layernorm.weight"))?),
                    Role::Reads(None) => Some(self.norm("model.norm.weight")?),
                    _ => None,
                };
                // W diag(s) Q, a block of rows at a time.
                let mut out = Vec::with_capacity(w.len());
                for rows in w.chunks(CHUNK * cols) {
                    let scaled: Vec<f64> = match &scale {
                        Some(s) => rows.chunks_exact(cols).flat_map(|r| r.iter().zip(s).map(|(&a, b)| f64::from(a) * b)).collect(),
                        None => rows.iter().map(|&a| f64::from(a)).collect(),
                    };
                    out.extend(super::gptq::matmul_f64(rows.len() / cols, cols, hidden, (&scaled, false), &self.q).iter().map(|&x| x as f32));
                }
                out
            }
            Role::Writes => {
                let [rows, cols] = shape[..] else { return Err(bad(format!("shape {shape:?} is not a matrix"))) };
                if rows != hidden {
                    return Err(bad(format!("{rows} rows, expected the hidden size {hidden}")));
                }
                // Qᵀ W (Q read transposed), a block of columns at a time.
                let mut out = vec![0f32; w.len()];
                for c0 in (0..cols).step_by(CHUNK) {
                    let cb = CHUNK.min(cols - c0);
                    let block: Vec<f64> = w.chunks_exact(cols).flat_map(|r| r[c0..c0 + cb].iter().map(|&a| f64::from(a))).collect();
                    let turned = super::gptq::matmul_f64(hidden, hidden, cb, (&self.q, true), &block);
                    for (o, t) in out.chunks_exact_mut(cols).zip(turned.chunks_exact(cb)) {
                        o[c0..c0 + cb].iter_mut().zip(t).for_each(|(o, &t)| *o = t as f32);
                    }
                }
                out
            }
        };
        if let Some(h) = self.r4.as_ref().filter(|_| name.ends_with("mlp.down_proj.weight")) {
            // W H: each row's blocks transformed (H is symmetric).
            h.apply(&mut f, shape[1]);
        }
        if let Some(h) = &self.r2 {
            if name.ends_with("self_attn.o_proj.weight") {
                h.apply(&mut f, shape[1]);
            } else if name.ends_with("self_attn.v_proj.bias") {
                // The values' bias turns with them (Qwen2).
                h.apply(&mut f, shape[0]);
            } else if name.ends_with("self_attn.v_proj.weight") {
                // Hd W_v per head: the transform runs down each column, over the head's rows.
                let (rows, cols) = (shape[0], shape[1]);
                let mut t: Vec<f32> = (0..rows * cols).map(|k| f[(k % rows) * cols + k / rows]).collect();
                h.apply(&mut t, rows);
                f = (0..rows * cols).map(|k| t[(k % cols) * rows + k / cols]).collect();
            }
        }
        Ok(OutTensor::owned(name.into(), dtype.safetensors(), shape, dtype.encode(&f)))
    }
}

/// Writes the model of the Hugging Face directory `input`, its residual stream rotated by
/// [`random_orthogonal`]`(hidden, seed)` (see the module) and `online`'s rotations folded,
/// into `output`: the input's shards (and index) under the same names, each tensor in its
/// input dtype, config.json with `tie_word_embeddings: false` (and R4's transform config),
/// the tokenizer and generation files copied. A tied head is written untied beside the
/// embedding. Streams: one output shard is held at a time, and one tensor in f32 with a
/// block of its rows (or columns) in f64.
pub fn rotate_dir(input: &Path, output: &Path, seed: u64, online: Online) -> Result<(), QuantizeError> {
    let mut config = read_json(&input.join("config.json"))?;
    let usage = |m: String| QuantizeError::Usage(format!("--rotate: {m}"));
    let hidden = config["hidden_size"].as_u64().ok_or_else(|| usage("config.json has no hidden_size".into()))? as usize;
    if config.get("num_local_experts").or(config.get("num_experts")).or(config.get("n_routed_experts")).is_some() {
        return Err(usage("MoE models are not rotated".into()));
    }
    // RMS norms that scale by their weight (Gemma's scale by 1 + w, and would fold wrongly).
    let arch = config["architectures"][0].as_str().unwrap_or("");
    if !ROTATABLE.contains(&arch) {
        return Err(usage(format!("architecture {arch:?} is not rotated (supported: {})", ROTATABLE.join(", "))));
    }
    let tied = config["tie_word_embeddings"].as_bool().unwrap_or(false);
    let head_dim = match config["head_dim"].as_u64() {
        Some(d) => d as usize,
        None => hidden / config["num_attention_heads"].as_u64().filter(|&n| n > 0).ok_or_else(|| usage("config.json has no num_attention_heads".into()))? as usize,
    };
    let r2 = head_dim.is_power_of_two().then_some(BlockTransform::Hadamard { block: head_dim });
    let r4 = match online {
        Online::None => None,
        Online::DownHadamard => {
            let ffn = config["intermediate_size"].as_u64().filter(|&f| f > 0).ok_or_else(|| usage("config.json has no intermediate_size".into()))? as usize;
            Some(BlockTransform::Hadamard { block: down_block(ffn) })
        }
    };
    let names = input_shards(input)?;
    let maps = names.iter().map(|n| map_file(&input.join(n))).collect::<Result<Vec<_>, _>>()?;
    let shards = maps.iter().zip(&names).map(|(m, n)| read_shard(m, &input.join(n))).collect::<Result<Vec<_>, _>>()?;
    let q = random_orthogonal(hidden, seed);
    let rotation = Rotation { q, hidden, r2, r4, shards: &shards };
    // A tied head is written from the embedding, in the embedding's shard.
    let untie = tied && !shards.iter().any(|s| s.names().contains(&&"lm_head.weight".to_string()));
    std::fs::create_dir_all(output).map_err(|e| io(output, e))?;
    let (mut weight_map, mut total) = (serde_json::Map::new(), 0usize);
    for (file, shard) in names.iter().zip(&shards) {
        let mut tensors: Vec<(String, TensorView<'_>)> = shard.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out = Vec::with_capacity(tensors.len() + 1);
        for (name, view) in &tensors {
            out.push(rotation.tensor(name, view)?);
            if untie && name == "model.embed_tokens.weight" {
                out.push(rotation.tensor("lm_head.weight", view)?);
            }
        }
        for t in &out {
            weight_map.insert(t.name.clone(), json!(file));
            total += t.data.len();
        }
        write_tensors(&output.join(file), &out, true)?;
    }
    if input.join("model.safetensors.index.json").exists() {
        write_json(&output.join("model.safetensors.index.json"), &json!({ "metadata": { "total_size": total }, "weight_map": weight_map }))?;
    }
    config["tie_word_embeddings"] = json!(false);
    if let Some(h) = &rotation.r4 {
        config["quantization_config"] = json!({
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "transform_config": down_transform_config(h.block()),
        });
    }
    write_json(&output.join("config.json"), &config)?;
    copy_model_files(input, output)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::random_orthogonal;

    /// `Qᵀ Q = I` to f64 rounding, for sizes with and without a power-of-two factor; the seed
    /// decides the matrix.
    #[test]
    fn random_orthogonal_is_orthogonal_and_seeded() {
        for n in [1, 7, 64, 96] {
            let q = random_orthogonal(n, 3);
            for i in 0..n {
                for j in 0..n {
                    let d: f64 = (0..n).map(|k| q[k * n + i] * q[k * n + j]).sum();
                    assert!((d - f64::from(u8::from(i == j))).abs() < 1e-12, "n {n}: column {i} . column {j} = {d}");
                }
            }
        }
        assert_eq!(random_orthogonal(16, 3), random_orthogonal(16, 3));
        assert_ne!(random_orthogonal(16, 3), random_orthogonal(16, 4));
    }
}
