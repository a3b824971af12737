"""The math of each mechanism as plain TensorFlow functions (no Keras objects)."""
