"""The shared decoder pieces and the built-in model families (llama3/, qwen3/, qwen3_moe/, deepseek_v3/).

The families register themselves when imported; the model registry imports them on its first lookup
(protocols/train_spec.BUILTIN_FAMILIES), so importing a shared piece (say models.shared.moe) does not pull every
family in.
"""
