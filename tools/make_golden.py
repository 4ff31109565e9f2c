#!/usr/bin/env python3
"""Golden outputs from Hugging Face transformers for tests/test_golden.cu (an outside reference).

Run by a developer when the fixtures must change, never by the tests (which need no Python):
    python3 -m venv /tmp/golden-venv && /tmp/golden-venv/bin/pip install torch transformers safetensors
    /tmp/golden-venv/bin/python tools/make_golden.py
The committed fixtures were made with transformers 5.24.0 and torch 2.15.0.

For each fixture, tests/data/golden/<name>/ holds:
  config.json, model.safetensors  a random tiny LlamaForCausalLM, written by save_pretrained (fp32)
  tokens.bin    llm.c shard: the batch stream (B*T + 1 tokens; sequence b is tokens [bT, bT + T])
                then B*T + 1 filler tokens, so that --val-frac 0.5 trains on exactly the batch
  score.bin     the batch's B windows of T + 1 tokens back to back (what --score reads)
  golden.safetensors  F32: batch [B, T+1], logits [B*T, V], loss [1] (mean over the B*T
                targets), and grad.<name> for every parameter (gradient of that mean loss)
The fixture "trained" is a checkpoint after 20 steps of training instead of a random one (see
make_trained): 4 layers, d_model 64, the byte vocabulary, batch 4 x 64 of held-out text.
The reference runs in float64. transformers keeps RMSNorm and the RoPE angles in fp32 even in
an fp64 model; both are patched below to stay in float64 (attention is sdpa, which runs in the
model's dtype; transformers 5 no longer casts logits to fp32), so the stored values are exact
to their fp32 rounding. Unpatched fp32 transformers agrees with them to 4e-7 of the logits' scale.
"""
import json
import math
import os
import struct

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as llama
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "golden")
B, T = 2, 12

# name: (heads, kv heads, tied, rope_theta, rms_norm_eps). All: d_model 24, ffn 32, vocab 32, 2 layers.
FIXTURES = {
    "gqa": (4, 2, False, 10000.0, 1e-5),
    "mha_tied": (4, 4, True, 10000.0, 1e-6),
    "mqa_theta100": (4, 1, False, 100.0, 0.05),  # large eps and fast rotations: both visible
}
# Saved by transformers in bf16 (torch_dtype bfloat16): the reference is float64 of the bf16
# weights, and golden.safetensors also holds "loss_bf16", what transformers computes in bf16.
BF16_FIXTURES = {"gqa_bf16": (4, 2, False, 10000.0, 1e-5)}
# Trained, not random: early training makes the residual stream share one large direction, so a
# layer's value vectors are nearly equal (their common part ~20 times their spread at the last
# layer) and the softmax backward's dP - rowsum(P * dP) cancels most of its bits. Random weights
# never do this; a precision loss there (the row term summed in fp32) moved the gradients of
# trained checkpoints 3-5 times further from float64 than fp32 arithmetic must. Seed 2 of the
# first four, the one where that loss was clearest in both attention paths (2.2e-5 against
# 3.8e-6 after the fix, in the golden tests' measure; the other seeds 1.2e-5 to 3.5e-5 before).
TRAINED_FIXTURES = {"trained": dict(d_model=64, layers=4, heads=4, kv_heads=2, ffn=128, T=64, B=4,
                                    steps=20, seed=2)}


def rmsnorm_fp64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rope_fp64(self, x, position_ids):
    hd = self.config.hidden_size // self.config.num_attention_heads
    rope = getattr(self.config, "rope_parameters", None) or {}  # transformers 5; 4.x: rope_theta
    theta = rope.get("rope_theta") or self.config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    angles = position_ids[..., None].to(torch.float64) * inv_freq  # [b, t, hd/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def write_shard(path, tokens):  # llm.c: 256 int32 header (magic, version, count), uint16 tokens
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}H", *tokens))


def init_weights(model, g):
    """O(1) activations and peaked attention and softmax rows (the default init gives near-uniform
    ones, where many bugs cancel): embeddings N(0,1), linears (a mixture's experts and router too)
    N(0, 1/in), the LM head twice that, norms 1 + N(0, 0.2^2)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed" in pname:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (2 if "lm_head" in pname else 1) / math.sqrt(p.shape[-1]))


def make(name, heads, kv_heads, tied, theta, eps, seed, bf16=False):
    cfg = LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=T, rope_theta=theta, rms_norm_eps=eps,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    init_weights(model, g)
    d = os.path.join(OUT, name)
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)
    os.remove(os.path.join(d, "generation_config.json"))

    stream = torch.randint(0, 32, (B * T + 1,), generator=g)
    batch = torch.stack([stream[b * T: b * T + T + 1] for b in range(B)])  # [B, T+1]
    write_shard(os.path.join(d, "tokens.bin"), stream.tolist() + torch.randint(0, 32, (B * T + 1,), generator=g).tolist())
    write_shard(os.path.join(d, "score.bin"), batch.flatten().tolist())

    if bf16:  # transformers' own bf16 forward, unpatched (its RMSNorm and RoPE as shipped)
        with patched(False), torch.no_grad():
            lb = model(input_ids=batch[:, :T]).logits.float()
            loss_bf16 = torch.nn.functional.cross_entropy(lb.reshape(B * T, -1), batch[:, 1:].reshape(-1))
    write_reference(name, d, model, batch, {"loss_bf16": loss_bf16.reshape(1)} if bf16 else {})


def write_reference(name, d, model, batch, extra):
    """golden.safetensors: the float64 logits, mean loss and gradients of `model`'s weights on `batch`."""
    B, T = batch.shape[0], batch.shape[1] - 1
    model = model.double()
    model.zero_grad(set_to_none=True)  # a trained model still holds its last step's gradients
    logits = model(input_ids=batch[:, :T]).logits.double()  # [B, T, V]
    loss = torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), batch[:, 1:].reshape(-1))
    loss.backward()
    out = {"batch": batch.float(), "logits": logits.reshape(B * T, -1), "loss": loss.reshape(1), **extra}
    for pname, p in model.named_parameters():  # tied: one tensor, both gradients summed
        out["grad." + pname] = p.grad
    save_file({k: v.detach().float().contiguous() for k, v in out.items()}, os.path.join(d, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: loss {loss.item():.6f}, {sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))} bytes")


def fortune_bytes():  # picoscale's default corpus, as runtime/data.cu reads it (files sorted by name)
    root = "/usr/share/games/fortunes"
    names = sorted(n for n in os.listdir(root) if "." not in n and os.path.isfile(os.path.join(root, n)))
    return b"".join(open(os.path.join(root, n), "rb").read() for n in names)


def make_trained(name, d_model, layers, heads, kv_heads, ffn, T, B, steps, seed):
    """A checkpoint trained as picoscale trains by default, in float64: N(0, 0.02) weights, AdamW
    (0.9, 0.95, eps 1e-8, weight decay 0.1), lr 2e-3 warmed up linearly over 20 steps, gradients
    clipped to norm 1, 8 windows of T + 1 bytes per step drawn from the first 800,000 bytes of the
    fortune corpus. Saved in fp32; the reference is float64 of those fp32 weights, on 4 windows
    of bytes the training never read (from byte 900,000). torch's float64 GEMMs may round
    differently on another machine: a regenerated fixture can differ in the last bits, and is
    as valid."""
    data = torch.tensor(list(fortune_bytes()[:1_000_000]))
    cfg = LlamaConfig(vocab_size=256, hidden_size=d_model, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=T,
                      rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.02,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).double()
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / 20)
        starts = torch.randint(0, 800_000, (8,), generator=g)
        xb = torch.stack([data[s: s + T + 1] for s in starts])  # [8, T+1]
        logits = model(input_ids=xb[:, :T]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), xb[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    d = os.path.join(OUT, name)
    model = model.float()
    model.save_pretrained(d, safe_serialization=True)
    os.remove(os.path.join(d, "generation_config.json"))
    stream = data[900_000: 900_000 + B * T + 1]  # the batch's stream, then as many filler bytes
    batch = torch.stack([stream[b * T: b * T + T + 1] for b in range(B)])  # [B, T+1]
    write_shard(os.path.join(d, "tokens.bin"), stream.tolist() + data[950_000: 950_000 + B * T + 1].tolist())
    write_shard(os.path.join(d, "score.bin"), batch.flatten().tolist())
    write_reference(name, d, model, batch, {})


MIXTRAL = {"mixtral": dict(experts=4, top_k=2, aux_coef=0.02, seed=3000)}


def router_fp64(self, hidden_states):  # transformers' MixtralTopKRouter, its softmax kept in float64
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    return logits, top / top.sum(dim=-1, keepdim=True), index


def aux_loss(router_logits, E, k):
    """The load-balancing loss as transformers' load_balancing_loss_func computes it (every layer's
    rows concatenated), in float64: E sum_e (C_e / rows)(S_e / rows)."""
    counts, sums, rows = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64), 0
    for z in router_logits:
        p = torch.softmax(z.double(), dim=-1)
        counts += torch.nn.functional.one_hot(torch.topk(p, k, dim=-1).indices, E).sum(dim=(0, 1))
        sums += p.sum(dim=0)
        rows += p.shape[0]
    return E * (counts / rows * (sums / rows)).sum()


def make_mixtral(name, experts, top_k, aux_coef, seed):
    """A random tiny MixtralForCausalLM (d_model 24, ffn 32 per expert, vocab 32, 2 layers, GQA),
    saved by save_pretrained. golden.safetensors holds, besides the Llama fixtures' entries (the
    loss there is the cross-entropy alone): aux (the load-balancing loss of the batch as one
    micro-batch), aux_transformers (transformers' own, in fp32), and grad.<hub name> of
    cross-entropy + aux_coef x aux; aux_mb and grad_mb.<hub name> the same with every sequence its
    own micro-batch (the aux loss the mean of the B sequences' losses), as data parallelism with
    one sequence per rank computes it. Hub names: the experts' fused gate_up_proj [E, 2F, D] is
    w1 (its first F rows) and w3, down_proj is w2."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.models.mixtral import modeling_mixtral as mixtral
    cfg = MixtralConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                        num_local_experts=experts, num_experts_per_tok=top_k, router_aux_loss_coef=aux_coef,
                        output_router_logits=True,  # the loss adds aux_coef x aux, as grad.* hold
                        attn_implementation="sdpa", experts_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    model = MixtralForCausalLM(cfg)
    init_weights(model, g)
    d = os.path.join(OUT, name)
    model.save_pretrained(d, safe_serialization=True)
    os.remove(os.path.join(d, "generation_config.json"))
    stream = torch.randint(0, 32, (B * T + 1,), generator=g)
    batch = torch.stack([stream[b * T: b * T + T + 1] for b in range(B)])
    write_shard(os.path.join(d, "tokens.bin"), stream.tolist() + torch.randint(0, 32, (B * T + 1,), generator=g).tolist())
    write_shard(os.path.join(d, "score.bin"), batch.flatten().tolist())
    with torch.no_grad():
        aux_tf = model(input_ids=batch[:, :T], output_router_logits=True).aux_loss.float()
    saved = mixtral.MixtralTopKRouter.forward
    mixtral.MixtralTopKRouter.forward = router_fp64
    mixtral.MixtralRMSNorm.forward = rmsnorm_fp64
    mixtral.MixtralRotaryEmbedding.forward = rope_fp64
    model = model.double()

    def hub(grads):  # transformers' fused names -> the hub's
        out = {}
        for pname, v in grads.items():
            if pname.endswith("experts.gate_up_proj"):
                base = pname[: -len("gate_up_proj")]
                for j in range(experts):
                    out[f"{base}{j}.w1.weight"] = v[j, : cfg.intermediate_size]
                    out[f"{base}{j}.w3.weight"] = v[j, cfg.intermediate_size:]
            elif pname.endswith("experts.down_proj"):
                base = pname[: -len("down_proj")]
                for j in range(experts):
                    out[f"{base}{j}.w2.weight"] = v[j]
            elif pname.endswith("mlp.gate.weight"):  # v5 names the block "mlp" in memory
                out[pname.replace("mlp.gate", "block_sparse_moe.gate")] = v
            else:
                out[pname] = v
        return {k.replace(".mlp.experts.", ".block_sparse_moe.experts."): v for k, v in out.items()}

    def run(micro):  # micro: the sequences of each micro-batch
        model.zero_grad(set_to_none=True)
        total_ce, total_aux, logits_all = 0, 0, []
        for seqs in micro:
            out = model(input_ids=batch[seqs, :T], output_router_logits=True)
            logits_all.append(out.logits.double().reshape(len(seqs) * T, -1))
            ce = torch.nn.functional.cross_entropy(logits_all[-1], batch[seqs, 1:].reshape(-1), reduction="sum") / (B * T)
            aux = aux_loss(out.router_logits, experts, top_k) / len(micro)
            (ce + aux_coef * aux).backward()
            total_ce, total_aux = total_ce + ce.detach(), total_aux + aux.detach()
        grads = hub({pname: p.grad for pname, p in model.named_parameters()})
        return torch.cat(logits_all), total_ce, total_aux, grads

    logits, loss, aux, grads = run([list(range(B))])
    _, _, aux_mb, grads_mb = run([[b] for b in range(B)])
    mixtral.MixtralTopKRouter.forward = saved
    out = {"batch": batch.float(), "logits": logits, "loss": loss.reshape(1), "aux": aux.reshape(1),
           "aux_transformers": aux_tf.reshape(1), "aux_mb": aux_mb.reshape(1)}
    out.update({"grad." + k: v for k, v in grads.items()})
    out.update({"grad_mb." + k: v for k, v in grads_mb.items()})
    save_file({k: v.detach().float().contiguous() for k, v in out.items()}, os.path.join(d, "golden.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    print(f"{name}: loss {loss.item():.6f}, aux {aux.item():.6f} (transformers {aux_tf.item():.6f}), per-sequence aux {aux_mb.item():.6f}")


ORIGINAL = (llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward)


class patched:  # with patched(on): the float64 RMSNorm and RoPE above, or transformers' own
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.saved = (llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward)
        llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward = (
            (rmsnorm_fp64, rope_fp64) if self.on else ORIGINAL)

    def __exit__(self, *args):
        llama.LlamaRMSNorm.forward, llama.LlamaRotaryEmbedding.forward = self.saved


if __name__ == "__main__":
    import sys
    only = sys.argv[1:]  # fixture names to write (default: all)
    llama.LlamaRMSNorm.forward = rmsnorm_fp64
    llama.LlamaRotaryEmbedding.forward = rope_fp64
    for i, (name, spec) in enumerate(FIXTURES.items()):
        if not only or name in only:
            make(name, *spec, seed=1000 + i)
    for i, (name, spec) in enumerate(BF16_FIXTURES.items()):
        if not only or name in only:
            make(name, *spec, seed=2000 + i, bf16=True)
    for name, spec in TRAINED_FIXTURES.items():
        if not only or name in only:
            make_trained(name, **spec)
    for name, spec in MIXTRAL.items():
        if not only or name in only:
            make_mixtral(name, **spec)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
