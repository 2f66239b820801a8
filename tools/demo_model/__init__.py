"""The demo model's training pipeline: corpus, tokenizer, training, export and checks (docs/demo_model.md)."""
