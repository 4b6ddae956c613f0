#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs into fuzz/corpus/<target>/seed-* (standard library only).

- gguf: tiny Llama GGUF files (F32 and Q8_0 weights, a small byte-level BPE vocabulary, ChatML
  template) that load completely: container, config, tensors, tokenizer and model;
- hf_checkpoint: `config.json NUL tokenizer_config.json NUL model.safetensors` for a tiny
  Llama (F32/F16/BF16 tensors; F32 with an online Hadamard transform) and two of
  engine/tests/fixtures/quant (AWQ, compressed-tensors W4A16);
- tokenizer_decode: u16 id sequences (ASCII, multi-byte UTF-8 split across tokens, control tokens);
- openai_request: typical completions, chat and Responses bodies (first byte: 0 completions,
  1 chat, 2 responses);
- chat_template: the default model's template (read from its GGUF when present), Llama-2 and
  Jinja feature templates, and hostile ones (loops, recursion, huge output), each followed by
  `NUL role NUL content` messages.

Run from anywhere: python3 fuzz/seeds/make_seeds.py
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- GGUF
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gval(v):
    """(type id, bytes) of a metadata value."""
    if isinstance(v, bool):
        return 7, struct.pack("<B", v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, gstr(v)
    if isinstance(v, tuple) and v[0] == "i32":
        return 9, struct.pack("<IQ", 5, len(v[1])) + b"".join(struct.pack("<i", x) for x in v[1])
    if isinstance(v, list):
        return 9, struct.pack("<IQ", 8, len(v)) + b"".join(gstr(x) for x in v)
    raise TypeError(v)


def f32s(n, seed):
    return b"".join(struct.pack("<f", ((i * 37 + seed * 11) % 17 - 8) / 16.0) for i in range(n))


def q8_0(n, seed):
    """n values (a multiple of 32) as Q8_0 blocks: f16 scale + 32 int8."""
    out = b""
    for blk in range(n // 32):
        out += struct.pack("<e", 0.01 * (1 + (blk + seed) % 5))
        out += bytes(((i * 7 + blk + seed) % 255) for i in range(32))
    return out


def tiny_gguf(hidden, ffn, qtype, tied=True, vocab_extra=0):
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "Ġ", "h", "i", "hi",
              "Ċ", "Ġa", "Ã", "©"] + ["t%d" % i for i in range(vocab_extra)]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    heads, kv_heads = 2, 1
    head_dim = hidden // heads
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": hidden,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.block_count": 1,
        "llama.feed_forward_length": ffn,
        "llama.context_length": 64,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": ("i32", types),
        "tokenizer.ggml.merges": ["a b", "h i", "Ġ a"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHATML,
    }
    v = len(tokens)
    # (name, [rows, cols] outermost first, quantizable)
    shapes = [("token_embd.weight", [v, hidden], True),
              ("blk.0.attn_norm.weight", [hidden], False),
              ("blk.0.attn_q.weight", [heads * head_dim, hidden], True),
              ("blk.0.attn_k.weight", [kv_heads * head_dim, hidden], True),
              ("blk.0.attn_v.weight", [kv_heads * head_dim, hidden], True),
              ("blk.0.attn_output.weight", [hidden, heads * head_dim], True),
              ("blk.0.ffn_norm.weight", [hidden], False),
              ("blk.0.ffn_gate.weight", [ffn, hidden], True),
              ("blk.0.ffn_up.weight", [ffn, hidden], True),
              ("blk.0.ffn_down.weight", [hidden, ffn], True),
              ("output_norm.weight", [hidden], False)]
    if not tied:
        shapes.append(("output.weight", [v, hidden], True))
    infos, blobs, off = b"", [], 0
    for i, (name, shape, quantizable) in enumerate(shapes):
        n = 1
        for d in shape:
            n *= d
        ty = qtype if quantizable else 0
        data = q8_0(n, i) if ty == 8 else f32s(n, i)
        infos += gstr(name) + struct.pack("<I", len(shape))
        infos += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        infos += struct.pack("<IQ", ty, off)
        pad = (-len(data)) % 32
        blobs.append(data + b"\0" * pad)
        off += len(data) + pad
    kv = b""
    for k, val in meta.items():
        ty, b = gval(val)
        kv += gstr(k) + struct.pack("<I", ty) + b
    head = b"GGUF" + struct.pack("<IQQ", 3, len(shapes), len(meta)) + kv + infos
    head += b"\0" * ((-len(head)) % 32)
    return head + b"".join(blobs)


def read_gguf_meta(path, wanted):
    """The string value of metadata key `wanted` in a GGUF file (None when absent)."""
    with open(path, "rb") as f:
        buf = f.read(16 << 20)
    pos = 24
    n_kv = struct.unpack_from("<Q", buf, 16)[0]
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def rstr(p):
        n = struct.unpack_from("<Q", buf, p)[0]
        return buf[p + 8:p + 8 + n].decode(), p + 8 + n

    def skip(ty, p):
        if ty in sizes:
            return p + sizes[ty]
        if ty == 8:
            return rstr(p)[1]
        et, n = struct.unpack_from("<IQ", buf, p)
        p += 12
        for _ in range(n):
            p = skip(et, p)
        return p

    for _ in range(n_kv):
        key, pos = rstr(pos)
        ty = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        if key == wanted and ty == 8:
            return rstr(pos)[0]
        pos = skip(ty, pos)
    return None


# ---------------------------------------------------------------- safetensors
def safetensors(tensors):
    """tensors: list of (name, dtype, shape, bytes)."""
    header, off, data = {}, 0, b""
    for name, dtype, shape, b in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(b)]}
        off += len(b)
        data += b
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def enc(n, dtype, seed):
    vals = [((i * 37 + seed * 11) % 17 - 8) / 16.0 for i in range(n)]
    if dtype == "F32":
        return b"".join(struct.pack("<f", x) for x in vals)
    if dtype == "F16":
        return b"".join(struct.pack("<e", x) for x in vals)
    return b"".join(struct.pack("<f", x)[2:] for x in vals)  # BF16: top half of f32


def tiny_hf(dtype, r4=False):
    """`r4`: with SpinQuant's online Hadamard before down_proj (a compressed-tensors
    transform_config holding only it, its 16 x 16 matrix stored as +-1 F32)."""
    hidden, ffn, vocab, heads, kv = 8, 16, 5, 2, 1
    hd = hidden // heads
    cfg = {"model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
           "num_key_value_heads": kv, "num_hidden_layers": 1, "intermediate_size": ffn,
           "vocab_size": vocab, "max_position_embeddings": 64, "tie_word_embeddings": True,
           "rms_norm_eps": 1e-5, "eos_token_id": 4}
    tcfg = {"bos_token": "a", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": False,
            "chat_template": CHATML}
    p = "model.layers.0."
    shapes = [("model.embed_tokens.weight", [vocab, hidden]),
              (p + "input_layernorm.weight", [hidden]),
              (p + "self_attn.q_proj.weight", [heads * hd, hidden]),
              (p + "self_attn.k_proj.weight", [kv * hd, hidden]),
              (p + "self_attn.v_proj.weight", [kv * hd, hidden]),
              (p + "self_attn.o_proj.weight", [hidden, heads * hd]),
              (p + "post_attention_layernorm.weight", [hidden]),
              (p + "mlp.gate_proj.weight", [ffn, hidden]),
              (p + "mlp.up_proj.weight", [ffn, hidden]),
              (p + "mlp.down_proj.weight", [hidden, ffn]),
              ("model.norm.weight", [hidden])]
    ts = []
    for i, (name, shape) in enumerate(shapes):
        n = 1
        for d in shape:
            n *= d
        ts.append((name, dtype, shape, enc(n, dtype, i)))
    if r4:
        tgt = ["re:.*down_proj$"]
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}, "transform_config": {
            "config_groups": {"R4": {"type": "hadamard", "head_dim": None, "apply": [
                {"targets": tgt, "location": "input"}, {"targets": tgt, "location": "weight_input", "inverse": True}]}}}}
        had = [1.0 if bin(i & j).count("1") % 2 == 0 else -1.0 for i in range(ffn) for j in range(ffn)]
        ts.append((p + "mlp.down_proj.R4_input.weight", "F32", [ffn, ffn], b"".join(struct.pack("<f", x) for x in had)))
    return json.dumps(cfg).encode() + b"\0" + json.dumps(tcfg).encode() + b"\0" + safetensors(ts)


def main():
    write("gguf", "tiny-f32.gguf", tiny_gguf(8, 16, 0))
    write("gguf", "tiny-q8_0.gguf", tiny_gguf(32, 64, 8, tied=False))
    for dt in ["F32", "F16", "BF16"]:
        write("hf_checkpoint", "tiny-%s" % dt.lower(), tiny_hf(dt))
    write("hf_checkpoint", "tiny-f32-r4", tiny_hf("F32", r4=True))
    qdir = os.path.join(ROOT, "engine", "tests", "fixtures", "quant")
    for fx in ["awq_g128", "ct_w4a16_actorder"]:
        d = os.path.join(qdir, fx)
        try:
            cfg = open(os.path.join(d, "config.json"), "rb").read()
            st = open(os.path.join(d, "model.safetensors"), "rb").read()
        except OSError:
            continue
        if len(st) <= 64 << 10:
            write("hf_checkpoint", fx, cfg + b"\0{}\0" + st)

    # tokenizer_decode: u16 ids (SmolLM2: 0-16 control tokens, bytes and merges above).
    for name, ids in {
        "ascii": [19556, 28, 905, 17, 216, 33, 34, 35],
        "control": [1, 4093, 198, 19556, 2, 198, 0, 65535],
        "split-utf8": [216, 161, 122, 162, 99, 100, 101, 180, 181, 60000, 49151, 49152],
        "empty": [],
    }.items():
        write("tokenizer_decode", name, b"".join(struct.pack("<H", i) for i in ids))

    # openai_request: first byte 0 = completions, 1 = chat.
    comps = {
        "prompt": {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
        "prompt-list": {"prompt": ["a", "b"], "n": 2, "seed": 7, "stop": ["\n", "END"], "logprobs": 2, "echo": True},
        "prompt-ids": {"prompt": [[1, 2, 3], [4, 5]], "top_k": 40, "top_p": 0.9, "min_p": 0.05, "stream": True,
                       "stream_options": {"include_usage": True}},
        "all-params": {"model": "tessera", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.5,
                       "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2, "max_tokens": 9,
                       "stop_token_ids": [5], "best_of": 1, "suffix": "", "user": "u"},
        "guided-regex": {"prompt": "Year:", "guided_regex": "(19|20)[0-9]{2}", "n": 2},
        "structured-choice": {"prompt": "x", "structured_outputs": {"choice": ["yes", "no"]}},
        "structured-lark": {"prompt": "x", "structured_outputs": {"grammar": "start: \"a\" NUM\nNUM: /[0-9]+/"}},
    }
    chats = {
        "chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        "chat-system": {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hello", "name": "ann"}],
                        "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4, "n": 2},
        "chat-parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                                    {"role": "assistant", "content": None}], "stream": True},
        "chat-json-schema": {"messages": [{"role": "user", "content": "A person"}],
                             "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
                                 "type": "object", "additionalProperties": False, "required": ["name", "tags"],
                                 "properties": {"name": {"type": "string", "maxLength": 9},
                                                "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}}}},
        "chat-json-object": {"messages": [{"role": "user", "content": "JSON"}], "response_format": {"type": "json_object"}},
    }
    for name, body in comps.items():
        write("openai_request", name, b"\0" + json.dumps(body).encode())
    for name, body in chats.items():
        write("openai_request", name, b"\1" + json.dumps(body).encode())
    responses = {
        "responses-text": {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0},
        "responses-items": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                                      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                                      {"type": "function_call_output", "call_id": "c1", "output": "rain"}],
                            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
                            "tool_choice": {"type": "function", "name": "get_weather"}, "stream": True},
        "responses-format": {"input": "A city", "text": {"format": {"type": "json_schema", "name": "c", "schema": {
                                 "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
                             "top_logprobs": 2, "include": ["message.output_text.logprobs"]},
    }
    for name, body in responses.items():
        write("openai_request", name, b"\2" + json.dumps(body).encode())
    write("openai_request", "not-json", b"\0{\"prompt\": ")

    # chat_template: template NUL role NUL content ...
    conv = b"\0system\0Be brief.\0user\0Hi there\0assistant\0Hello!\0user\0Bye"
    templates = {
        "chatml": CHATML,
        "llama2": "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                  "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{% if m['role'] == 'user' %}"
                  "{{ '[INST] ' + m['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}"
                  "{% endif %}{% endfor %}",
        "features": "{% set ns = namespace(n=0) %}{% macro f(x) %}{{ x|upper }}{% endmacro %}{% for m in messages|reverse %}"
                    "{% set ns.n = ns.n + 1 %}{{ f(m.content) }}{{ m.name or '-' }}{{ m.content|length }}{{ m.content.split(' ')|join(',') }}"
                    "{% if loop.last %}{{ ns.n }}{% endif %}{% endfor %}{{ messages|tojson }}{{ range(3)|list }}",
        "loop": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "huge-output": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
        "recursive-loop": "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    }
    real = read_gguf_meta(MODEL, "tokenizer.chat_template") if os.path.exists(MODEL) else None
    if real:
        templates["smollm2"] = real
    else:
        print("note: %s missing; its chat template is not a seed" % MODEL, file=sys.stderr)
    for name, src in templates.items():
        write("chat_template", name, src.encode() + conv)


if __name__ == "__main__":
    main()
