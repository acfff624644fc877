"""The pieces the model families share: the decoder and its args contract, attention and its kernels, RoPE, the
feed-forward and MoE layers, Gated DeltaNet, the LoRA layer, µP, seeded init, document masking, the chunked loss
head, the shared tensor-parallel plan and the Hugging Face adapter. A family's folder holds only what differs."""
