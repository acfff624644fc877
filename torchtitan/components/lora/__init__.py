"""LoRA and QLoRA fine-tuning: the "lora" model converter and adapters in PEFT's format."""
