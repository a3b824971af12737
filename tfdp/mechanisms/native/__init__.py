"""tfdp's compiled TensorFlow ops (C++ sources built on first use by `build`)."""
