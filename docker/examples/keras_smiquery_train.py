"""Train a small Keras model on synthetic data with smiquery's Keras callback watching the GPUs.

An example for the TensorFlow image (docker/Dockerfile.tensorflow): docker/compose.yaml runs it as the ``trainer``
service and docker/k8s/tensorflow-job.yaml as a Job (from a ConfigMap copy of this file).

:class:`smiquery.training.keras.GpuMonitor` runs ONE background nvidia-smi loop for the whole fit and writes each epoch's
GPU summary into the logs (``gpu0_util_mean``, ``gpu0_mem_used_max_mib``, ...), so ``History`` and ``CSVLogger``
record it like any metric; alert rules (hot GPU, lost GPU...) are logged with the epoch and batch they fired in.
Without nvidia-smi (a container started without ``--gpus all`` / the ``utility`` capability) it says so once and
training goes on.

Environment: EPOCHS (default 5), STEPS (batches per epoch, default 200), GPU_SAMPLE_INTERVAL (seconds, default 1),
CSV_LOG (a CSV file for the per-epoch logs, default none). The job's own Prometheus metrics (steps, samples, energy,
``smiquery_training_gpu_info``; what GpuStalledPipeline and TrainingJobHung join to the exporter's GPUs, see
docs/training.md): METRICS_PORT serves them (compose: 9400 on 127.0.0.1; Kubernetes: 9400 on the pod's address,
METRICS_ADDR=0.0.0.0), METRICS_WEB_CONFIG protects them (TLS, basic auth: the exporter's web-config format),
PUSHGATEWAY pushes them instead; SMIQUERY_RUN_ID names the run (the pod's name in Kubernetes).
"""

from __future__ import annotations

import os

import keras
import numpy as np

from smiquery.training.keras import GpuMonitor


def main() -> None:
    epochs = int(os.environ.get("EPOCHS", "5"))
    steps = int(os.environ.get("STEPS", "200"))
    interval = float(os.environ.get("GPU_SAMPLE_INTERVAL", "1"))
    csv_log = os.environ.get("CSV_LOG")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 64, 256)).astype("float32")
    y = (x[:, :8].sum(axis=1) > 0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input(shape=(256,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])

    # GpuMonitor first, so that the callbacks after it (CSVLogger, TensorBoard) see its keys.
    port = os.environ.get("METRICS_PORT")
    monitor = GpuMonitor(
        interval=interval,
        metrics_port=int(port) if port else None,
        metrics_addr=os.environ.get("METRICS_ADDR", "127.0.0.1"),
        web_config=os.environ.get("METRICS_WEB_CONFIG") or None,
        pushgateway=os.environ.get("PUSHGATEWAY") or None,
    )
    callbacks: list[keras.callbacks.Callback] = [monitor]
    if csv_log:
        callbacks.append(keras.callbacks.CSVLogger(csv_log))
    history = model.fit(x, y, batch_size=64, epochs=epochs, callbacks=callbacks, verbose=2)

    gpu_keys = sorted(k for k in history.history if k.startswith("gpu"))
    print("GPU metrics per epoch:", ", ".join(gpu_keys) or "none", flush=True)
    for note in monitor.notes:
        print("smiquery:", note, flush=True)
    for alert in monitor.alerts:
        print("smiquery alert:", alert.to_dict(), flush=True)


if __name__ == "__main__":
    main()
