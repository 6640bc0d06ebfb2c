"""Training of the project's own small models: data loaders, the chat template, the byte-level BPE
tokenizer, the target language model and its drafters.

- :mod:`taps.train.data`      loaders of the chat / math training text (evaluation prompts: :mod:`taps.data`;
                              the chat template: :mod:`taps.chat`)
- :mod:`taps.train.tokenizer` train and save the byte-level BPE tokenizer (Hugging Face format)
- :mod:`taps.train.target`    train the target causal LM (resumable, CPU or GPU) and export it
- :mod:`taps.train.drafter`   train EAGLE-style drafters on the target's features (EAGLE-2, HASS)
- :mod:`taps.train.eagle3`    train EAGLE-3 heads on the target's multi-layer features
- :mod:`taps.train.loop`      what the trainers share: the run configuration, schedule, checkpoints, log
- :mod:`taps.train.dist`      data-parallel training under torchrun (ranks, sharding, DDP / FSDP)
- :mod:`taps.train.vocab`     the drafters' training-token counts (reduced draft vocabularies)
- :mod:`taps.train.cli`       ``taps train tokenizer|target|drafter|average|vocab`` subcommands; the drafter
                              families' dispatch to their trainers

Nothing here needs the ``taps_ops`` extension. Heavy imports (transformers, tokenizers) happen inside
the modules that need them.
"""
