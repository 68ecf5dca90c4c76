"""Tiny random-weight models written by the tests themselves (no downloads).

`write_qwen2_gguf` writes a qwen2-architecture GGUF (fp32) with a small SentencePiece-style vocabulary that
llama.cpp can tokenize (byte fallback). `write_qwen2_gguf_from_hf` writes the GGUF twin of a tiny
transformers Qwen2 model, so transformers and llama.cpp run the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

N_SPECIAL = 3  # <unk>, <s>, </s>
BOS_ID, EOS_ID = 1, 2
WORDS = ("the", "and", "to", "of", "a", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "as",
         "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but")


@dataclass
class TinyConfig:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 384
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then '▁' + letters and common words, padded to n_vocab."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = ["▁"] + [f"▁{w}" for w in WORDS] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += [f"▁{chr(c)}" for c in range(ord("a"), ord("z") + 1)]
    for p in pieces:
        if len(tokens) >= n_vocab:
            break
        if p not in tokens:
            tokens.append(p)
            types.append(1)
    i = 0
    while len(tokens) < n_vocab:
        tokens.append(f"<unused{i}>")
        types.append(5)
        i += 1
    scores = [0.0] * N_SPECIAL + [0.0] * 256 + [-float(i) for i in range(len(tokens) - N_SPECIAL - 256)]
    return tokens, scores, types


def random_qwen2_weights(cfg: TinyConfig, seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    """HF-named fp32 weights of a Qwen2 model (nn.Linear layout [out, in])."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.n_embd, cfg.head_dim
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.normal(0, 1.0, (cfg.n_vocab, d)),
        "model.norm.weight": 1.0 + rng.normal(0, 0.05, d),
        "lm_head.weight": rng.normal(0, scale, (cfg.n_vocab, d)),
    }
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + rng.normal(0, 0.05, d)
        w[p + "post_attention_layernorm.weight"] = 1.0 + rng.normal(0, 0.05, d)
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, scale * 4, (cfg.n_head * hd, d))
        w[p + "self_attn.q_proj.bias"] = rng.normal(0, 0.1, cfg.n_head * hd)
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, scale * 4, (cfg.n_head_kv * hd, d))
        w[p + "self_attn.k_proj.bias"] = rng.normal(0, 0.1, cfg.n_head_kv * hd)
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, scale, (cfg.n_head_kv * hd, d))
        w[p + "self_attn.v_proj.bias"] = rng.normal(0, 0.1, cfg.n_head_kv * hd)
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, scale, (d, cfg.n_head * hd))
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, scale, (cfg.n_ff, d))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, scale, (cfg.n_ff, d))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, scale, (d, cfg.n_ff))
    return {k: v.astype(np.float32) for k, v in w.items()}


HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    assert parts[0] == "model" and parts[1] == "layers", hf_name
    return f"blk.{parts[2]}.{HF_TO_GGUF_LAYER['.'.join(parts[3:])]}"


def write_qwen2_gguf(path: str | Path, weights: dict[str, np.ndarray], cfg: TinyConfig, *,
                     name: str = "tiny-qwen2", extra_kv: dict[str, str] | None = None) -> Path:
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(name)
    writer.add_context_length(cfg.n_ctx_train)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_head_kv)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, scores, types = spm_vocab(cfg.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value)
    for hf_name, arr in weights.items():
        writer.add_tensor(gguf_tensor_name(hf_name), np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(path: str | Path, cfg: TinyConfig | None = None, seed: int = 0, **kw) -> Path:
    cfg = cfg or TinyConfig()
    return write_qwen2_gguf(path, random_qwen2_weights(cfg, seed), cfg, **kw)


def hf_config_of(cfg: TinyConfig):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd, intermediate_size=cfg.n_ff,
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_head_kv, max_position_embeddings=cfg.n_ctx_train,
                       rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=False,
                       bos_token_id=BOS_ID, eos_token_id=EOS_ID, torch_dtype="float32")


def tiny_hf_qwen2(cfg: TinyConfig | None = None, seed: int = 0):
    """A transformers Qwen2ForCausalLM holding `random_qwen2_weights(cfg, seed)`."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = cfg or TinyConfig()
    model = Qwen2ForCausalLM(hf_config_of(cfg)).eval()
    state = {k: torch.from_numpy(v) for k, v in random_qwen2_weights(cfg, seed).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def write_qwen2_gguf_from_hf(hf_model, path: str | Path, **kw) -> Path:
    """The GGUF twin (fp32) of a transformers Qwen2 model."""
    c = hf_model.config
    cfg = TinyConfig(n_layer=c.num_hidden_layers, n_embd=c.hidden_size, n_head=c.num_attention_heads,
                     n_head_kv=c.num_key_value_heads, n_ff=c.intermediate_size, n_vocab=c.vocab_size,
                     n_ctx_train=c.max_position_embeddings, rope_theta=float(getattr(c, "rope_theta", 10000.0)),
                     rms_eps=c.rms_norm_eps)
    weights = {k: v.detach().float().cpu().numpy() for k, v in hf_model.state_dict().items() if "rotary" not in k}
    if "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return write_qwen2_gguf(path, weights, cfg, **kw)
