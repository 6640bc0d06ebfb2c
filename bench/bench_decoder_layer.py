"""Microbenchmark of taps_ops.decoder_layer against the Python layer body it replaces (taps.lean).

    PYTHONPATH=python python bench/bench_decoder_layer.py [--repeats 2000] [--isa LEVELS]

Rows: one Llama decoder layer at decoding sizes (hidden, heads / kv heads x head dim, MLP width, tokens T,
keys already cached), fp32 and bf16, weights fused and packed as the engine holds them
(``LayerWeights.pack``), attention through ``taps_ops.tree_attention`` with T tree nodes after the cached
keys. Columns: the Python body (``taps.lean.decoder_layer`` through a plain callback), the op (the same
function through a ``TreeAttend``, one call), the ratio, and the floor: the layer's weights and the K/V it
reads, once, at ``--gbps`` (default 20 GB/s for one core of the development CPU). Small layers are far
from it: their time is the operators' fixed costs, which is what the op cuts. The op runs once per
instruction-set level of the taps kernels (``--isa``, see bench/common.py: its rms_norm, rope_ and
tree_attention; its linears are ATen's, oneDNN's and MKL's, whose level ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA
and MKL_ENABLE_INSTRUCTIONS set), next to the Python body measured once (at the level in force when the benchmark
starts).
"""

from __future__ import annotations

import torch

from bench_rms_norm import compare, start  # noqa: E402  (bench/ is on the path when run as a script)

from taps.kv import TreeAttend, pack_bits  # noqa: E402
from taps.lean import LayerWeights, RopeTable, decoder_layer  # noqa: E402


def _layer(hidden, heads, kv, dim, inter, dtype):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                                   num_attention_heads=heads, num_key_value_heads=kv, head_dim=dim,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    return model, LayerWeights([model.model.layers[0]]).pack()


def main() -> None:
    columns = f"{'H':>5} {'heads':>7} {'MLP':>6} {'T':>3} {'keys':>5} {'dtype':>8}"
    args, _ = start(__doc__, None, columns, "python", "op")
    args.repeats = max(args.repeats // 10, 20)  # a layer is 10-100x an elementwise op
    print(f"a layer: mean of {args.repeats} calls")
    for hidden, heads, kv, dim, inter, tokens, cached in ((64, 4, 2, 16, 128, 8, 100), (64, 4, 2, 16, 128, 32, 100),
                                                           (256, 8, 4, 32, 768, 4, 200), (256, 8, 4, 32, 768, 16, 200),
                                                           (2048, 16, 4, 128, 5632, 32, 500)):
        for dt in (torch.float32, torch.bfloat16):
            model, w = _layer(hidden, heads, kv, dim, inter, dt)
            span = cached + tokens
            x = torch.randn(1, tokens, hidden).to(dt)
            keys = torch.randn(1, kv, span + 8, dim).to(dt)
            values = torch.randn(1, kv, span + 8, dim).to(dt)
            bits = pack_bits(torch.ones(tokens, tokens, dtype=torch.bool).tril()).unsqueeze(0)
            kv_lens = torch.tensor([span])
            table = RopeTable(model.model.rotary_emb, dt)
            table.ensure(span, torch.device("cpu"))
            cos, sin = table(range(cached, span), (1, tokens))
            attend = TreeAttend([(keys, values)], [w], bits, kv_lens, None, cached)

            def python():
                return decoder_layer(w, 0, x, cos, sin, lambda *a: attend(*a), 1, tokens)

            def op():
                return decoder_layer(w, 0, x, cos, sin, attend, 1, tokens)

            assert torch.equal(python(), op())
            params = sum(p.numel() for p in model.model.layers[0].parameters()) * x.element_size()
            moved = params + 2 * kv * span * dim * x.element_size()
            compare(args, "cpu", f"{hidden:5} {f'{heads}/{kv}x{dim}':>7} {inter:6} {tokens:3} {cached:5} "
                                 f"{str(dt)[6:]:>8}", python, op, moved)


if __name__ == "__main__":
    main()
