"""Rotates a Hugging Face Llama directory with llm-compressor's QuIP template, as its
QuIPModifier applies it by default (compressed-tensors' apply_transform_config: `v` on every
Linear's input, `u` on its output, both random-hadamard and randomized, lm_head ignored), and
saves it as a float checkpoint with its transform_config: a real library-written rotated model
for Tessera to serve (docs/benchmarks/quantized-quality.md). Tensors the library ties (one
matrix per width) are saved once, as transformers saves tied weights. Optionally prints
transformers' own mean NLL over the first 256 tokens of TEXT, with the online transforms
attached.

Needs the fixture venv (engine/tests/fixtures/requirements-quant.txt):
    /tmp/qfix/bin/python scripts/quip-rotate.py IN_DIR OUT_DIR [float32|bfloat16] [TEXT]
"""
import json, shutil, sys
from pathlib import Path
import torch
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme, apply_transform_config
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
quip = TransformConfig(config_groups={
    "v": TransformScheme(type="random-hadamard", randomize=True, apply=[
        TransformArgs(targets=["Linear"], location="input", ignore="lm_head"),
        TransformArgs(targets=["Linear"], location="weight_input", inverse=True, ignore="lm_head")]),
    "u": TransformScheme(type="random-hadamard", randomize=True, apply=[
        TransformArgs(targets=["Linear"], location="weight_output", ignore="lm_head"),
        TransformArgs(targets=["Linear"], location="output", inverse=True, ignore="lm_head")]),
})
apply_transform_config(model, quip)
dst.mkdir(parents=True, exist_ok=True)
sd = {k: v.contiguous() for k, v in model.state_dict().items()}
sd.pop("lm_head.weight", None)  # tied to the embedding
seen = set()
for k in sorted(sd):
    key = (sd[k].untyped_storage().data_ptr(), sd[k].storage_offset(), tuple(sd[k].shape))
    if key in seen:
        del sd[k]
    seen.add(key)
save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
cfg = json.loads((src / "config.json").read_text())
cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}, "transform_config": quip.model_dump()}
(dst / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
for f in src.iterdir():
    if f.name.startswith("tokenizer") or f.name == "generation_config.json":
        shutil.copy(f, dst / f.name)
# the reference: transformers' own forward (online transforms attached) on a fixed text
text = (Path(sys.argv[4]).read_text()[:3000]) if len(sys.argv) > 4 else None
if text:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits, -1)
    nll = -lp[0, :-1].gather(-1, ids[0, 1:, None]).mean().item()
    print("transformers mean NLL over", ids.shape[1] - 1, "tokens:", nll)
print("saved", dst, len(sd), "tensors")
