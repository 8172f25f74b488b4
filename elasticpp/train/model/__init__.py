"""The model side of training: the contract every model declares (`contract`), a pipeline
stage of any model on it (`stage`), the built-in families (`families`), Hugging Face
interop (`hf`, `hfconfig`) and model references (`modelref`). Import each name from its
module."""
