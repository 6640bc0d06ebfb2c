"""Training of the project's own small models: data loaders, the chat template, the byte-level BPE
tokenizer and the target language model.

- :mod:`taps.train.data`      loaders of the chat / math training text (evaluation prompts: :mod:`taps.data`;
                              the chat template: :mod:`taps.chat`)
- :mod:`taps.train.tokenizer` train and save the byte-level BPE tokenizer (Hugging Face format)
- :mod:`taps.train.target`    train the target causal LM (resumable, CPU or GPU) and export it
- :mod:`taps.train.drafter`   train EAGLE-style drafters on the target's features (EAGLE-2, HASS)
- :mod:`taps.train.dist`      data-parallel training under torchrun (ranks, sharding, DDP / FSDP)
- :mod:`taps.train.cli`       ``taps train tokenizer|target|drafter|average`` subcommands

Nothing here needs the ``taps_ops`` extension. Heavy imports (transformers, tokenizers) happen inside
the modules that need them.
"""
