"""Text -> tokens -> fixed-length blocks -> a deterministic train/validation split (a LightningDataModule)."""
