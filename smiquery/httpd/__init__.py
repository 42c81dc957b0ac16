"""HTTP serving shared by the exporter and the training job's metrics: a hardened server and its web config."""
