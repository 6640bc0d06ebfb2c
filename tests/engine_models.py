"""Tiny Llama targets and drafters that agree with them, for the engine suites (fp32, CPU), built once.

Drafters that never get a token accepted test nothing about acceptance, so the drafters here are made
to agree with their target:

- an EAGLE head trained for a few hundred steps on the target's own greedy outputs and hidden states
  (the EAGLE-2 objective of taps.train.drafter), and a second one fine-tuned from it on other batches
  (checkpoint averaging needs two heads with a common ancestor);
- the target's first layer read out by its own norm and head (an early-exit causal LM);
- the target itself (whole chains accepted).
"""

import numpy as np
import torch
import transformers

from taps import synthetic
from taps.train.drafter import DrafterTrainConfig, drafter_losses, new_drafter, target_features

from conftest import one_torch_thread

_CACHE = {}


def llama(vocab, hidden, layers, seed, head_scale=1.0):
    """A random LlamaForCausalLM; `head_scale` sharpens its next-token distributions."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, initializer_range=0.1,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model


early_exit = synthetic.early_exit  # the target's first layers, its final norm and its head, as a causal LM


@torch.no_grad()
def greedy_sequences(target, count, prompt_len, new_tokens, seed):
    """[count, prompt_len + new_tokens] random prompts continued by the target's greedy decoding."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, target.config.vocab_size, (count, prompt_len), generator=gen)
    return target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def train_eagle(target, seqs, steps, seed, start=None, lr=1e-2):
    """An EAGLE head (new, or a copy of `start`) trained `steps` Adam steps on token sequences `seqs`
    [n, L] and the target's features of them; eval mode, bound to the target."""
    feats = target_features(target, seqs, "cpu", quiet=True).float()
    head = start.clone() if start is not None else new_drafter(target)
    cfg = DrafterTrainConfig(family="eagle2", cls_weight=1.0)
    head_w = target.get_output_embeddings().weight.detach()
    embed_w = target.get_input_embeddings().weight.detach()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for _ in range(steps):
        idx = torch.randint(0, len(seqs), (16,), generator=gen)
        loss, _ = drafter_losses(head, head_w, embed_w, seqs[idx], feats[idx], cfg, 1, 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    head.requires_grad_(False)
    head.bind(target)
    return head


def _models(name, target_args, new_tokens, steps, other_args, seed):
    """target, eagle (trained `steps[0]` steps on the target's greedy continuations of random prompts),
    eagle2 (eagle fine-tuned `steps[1]` steps on others), early_exit, other (an unrelated random LM
    that agrees with nothing), seqs (eagle's training sequences); built once per name."""
    if name not in _CACHE:
        with one_torch_thread():
            target = llama(*target_args)
            seqs = greedy_sequences(target, 64, 4, new_tokens, seed=seed)
            eagle = train_eagle(target, seqs, steps[0], seed=seed + 1)
            more = greedy_sequences(target, 64, 4, new_tokens, seed=seed + 2)
            _CACHE[name] = dict(target=target, eagle=eagle, eagle2=train_eagle(target, more, steps[1], seed + 3, eagle),
                                early_exit=early_exit(target), other=llama(*other_args), seqs=seqs)
    return _CACHE[name]


def greedy_models():
    """The greedy suites' models (see _models): a target of vocabulary 96, hidden 32, 2 layers."""
    return _models("greedy", (96, 32, 2, 1, 4.0), 40, (350, 60), (96, 16, 1, 2), seed=0)


def sampling_models():
    """The sampling suites' models (see _models): a target of vocabulary 32, hidden 16, 1 layer, with
    sharp next-token distributions (chi-square tests over its first three tokens need few cells)."""
    return _models("sampling", (32, 16, 1, 11, 6.0), 30, (200, 40), (32, 16, 1, 12, 3.0), seed=10)


def frequent_tokens(seqs, size, seed=0):
    """The `size` most frequent ids of `seqs`, in a shuffled order (draft vocabularies need not be sorted)."""
    counts = torch.bincount(seqs.flatten())
    top = counts.argsort(descending=True)[:size]
    return top[torch.randperm(size, generator=torch.Generator().manual_seed(seed))]


def pad_prompts(prompts):
    """(ids [B, L] int64, zero-padded on the right, lens [B]) of token-id lists of any lengths."""
    ids = torch.zeros((len(prompts), max(len(p) for p in prompts)), dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.as_tensor(p)
    return ids, torch.tensor([len(p) for p in prompts])


@torch.no_grad()
def randomize_(module, scale):
    """Draw every matrix parameter of `module` from N(0, scale) (random but not tiny, so that a head's
    outputs depend on its inputs); returns the module."""
    for p in module.parameters():
        if p.dim() > 1:
            p.normal_(0, scale)
    return module


@torch.no_grad()
def greedy_reference(model, prompt, steps):
    """The model's own greedy continuation: a plain Hugging Face forward over the whole sequence per
    token (no cache, no taps kernel)."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def exact_joint(model, prompt, steps, probs, eos=()):
    """{token tuple: probability} of every sequence of the model's first `steps` sampled tokens after
    `prompt` with probability > 0, where `probs(logits_row)` is the sampling distribution ([V] numpy)
    and a sequence stops at its first token in `eos`. Plain Hugging Face forwards."""
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(steps):
            open_ = [s for s in joint if not (s and s[-1] in eos)]
            done = {s: p for s, p in joint.items() if s and s[-1] in eos}
            logits = model(input_ids=torch.tensor([list(prompt) + list(s) for s in open_])).logits[:, -1]
            for s, row in zip(open_, logits):
                p = probs(row)
                for x in np.nonzero(p)[0].tolist():
                    done[s + (x,)] = joint[s] * float(p[x])
            joint = done
    return joint


_HF_GREEDY = {}


@torch.no_grad()
def hf_greedy(model, prompt, max_new_tokens, eos=None):
    """The model's own greedy decoding (``model.generate(do_sample=False)``, the Hugging Face loop and
    cache, no taps kernel): the new tokens, ending with the first EOS when one is produced. Cached."""
    eos = sorted({eos} if isinstance(eos, int) else set(eos or ()))
    key = (id(model), tuple(prompt), max_new_tokens, tuple(eos))
    if key not in _HF_GREEDY:
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, num_beams=1,
                                               eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
        ids = torch.tensor([list(prompt)], device=model.device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _HF_GREEDY[key] = seq[0, len(prompt):].tolist()
    return _HF_GREEDY[key]


class GreedyCalls:
    """Records every greedy ``SpeculativeDecoder.generate`` call made inside ``with GreedyCalls() as c``
    (the decoder's target, each request's prompt ids, max_new_tokens, EOS and output tokens), so that a
    command's outputs can be checked against :func:`hf_greedy` afterwards (:meth:`check`)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        import inspect

        from taps import SpeculativeDecoder

        original = SpeculativeDecoder.generate
        signature = inspect.signature(original)
        calls = self.calls

        def generate(dec, *args, **kwargs):
            out = original(dec, *args, **kwargs)
            bound = signature.bind(dec, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if isinstance(a["temperature"], (int, float)) and a["temperature"] == 0:
                calls.append((dec.target, dec.prompt_ids(a["inputs"]), a["max_new_tokens"], a["eos_token_id"],
                              out.tokens, dec.strategy.name))
            return out

        self._restore = (SpeculativeDecoder, original)
        SpeculativeDecoder.generate = generate
        return self

    def __exit__(self, *exc):
        cls, original = self._restore
        cls.generate = original

    def check(self, min_calls=1):
        """Every recorded output equals the target's own Hugging Face greedy decoding; returns the
        strategies seen."""
        assert len(self.calls) >= min_calls, f"{len(self.calls)} greedy generate calls recorded"
        for target, prompts, max_new, eos, tokens, strategy in self.calls:
            for prompt, got in zip(prompts, tokens):
                assert got == hf_greedy(target, prompt, max_new, eos), f"{strategy}: differs from the target's greedy"
        return {c[-1] for c in self.calls}
