"""Checkpoints: DCP saves and resumes, where they are kept (folders, URLs), what each part of a run contributes,
Hugging Face folders, the frozen base's fingerprint and the run's provenance."""
