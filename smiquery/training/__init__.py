"""Training runs: one nvidia-smi beside a training loop, summarised per epoch, and the Keras and Lightning callbacks."""
