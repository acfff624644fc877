"""Measuring a model beside training: validation loss and perplexity, our models behind lm-evaluation-harness,
and its tasks run during training ([eval])."""
