"""Where models and text come from: HF directories and hub ids, torchtune builders, the embedded default; the architecture check."""
