"""Glue into the frameworks users train with (`weightbus.integrations.trl`: Hugging Face TRL's
GRPOTrainer). An integration imports the library and the engines' trainer-side targets, never
the apps; nothing in the library or the engines imports an integration."""
