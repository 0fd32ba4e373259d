"""Fit a Keras 3 model on a Spark DataFrame with ``horovod.spark.keras.KerasEstimator``, then predict with it.

Runs as written on a laptop (a local Spark with two task slots, the store in a temporary directory):

    pip install -e '.[spark,tensorflow]'      # needs a Java runtime (17+) for Spark 4
    python examples/spark/keras_spark_estimator.py
    python examples/spark/keras_spark_estimator.py --store /shared/nfs/horovod --run-id linear_1   # resumable

On a cluster, submit it with ``spark-submit --master <url> examples/spark/keras_spark_estimator.py --master ''
--store <path every executor sees, or s3://...>``; every executor needs horovod and tensorflow installed.  Run
it again with the same ``--run-id`` and the fit resumes from that run's checkpoint in the store.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

W_TRUE, B_TRUE = np.array([0.5, -1.0, 2.0]), -0.4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]", help="Spark master ('' = keep spark-submit's)")
    parser.add_argument("--num-proc", type=int, default=2, help="Horovod processes")
    parser.add_argument("--store", default=None, help="store prefix (default: a temporary directory)")
    parser.add_argument("--run-id", default=None, help="run ID (default: keras_<time>); reuse it to resume")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rows", type=int, default=2000)
    args = parser.parse_args()

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import SparkSession

    from horovod.spark.common.store import Store
    from horovod.spark.keras import KerasEstimator

    builder = SparkSession.builder.appName("keras_spark_estimator")
    if args.master:
        builder = builder.master(args.master)
    spark = builder.getOrCreate()
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(args.rows, 3))
        y = x @ W_TRUE + B_TRUE + rng.normal(scale=0.01, size=args.rows)   # a linear map plus a little noise
        df = spark.createDataFrame([(Vectors.dense(r), float(t)) for r, t in zip(x, y)], ["features", "y"])

        store = Store.create(args.store or tempfile.mkdtemp(prefix="horovod_store_"))
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        estimator = KerasEstimator(num_proc=args.num_proc, store=store, model=model,
                                   optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                                   feature_cols=["features"], label_cols=["y"], validation=0.1, batch_size=32,
                                   epochs=args.epochs, run_id=args.run_id, verbose=0)
        keras_model = estimator.fit(df)

        history = keras_model.getHistory()
        print(f"run {keras_model.getRunId()}: {len(history['loss'])} epochs, final loss {history['loss'][-1]:.5f}, "
              f"val_loss {history['val_loss'][-1]:.5f}")
        kernel, bias = keras_model.getModel().layers[-1].get_weights()
        learned = ", ".join(f"{w:.3f}" for w in kernel.reshape(-1))
        print(f"learned w=[{learned}] b={float(bias[0]):.3f} (true w={W_TRUE.tolist()} b={B_TRUE})")

        predictions = keras_model.transform(df).select("features", "y", "y__output")
        predictions.show(3, truncate=False)
        error = max(abs(r["y"] - r["y__output"]) for r in predictions.collect())
        print(f"largest |y - prediction| over {args.rows} rows: {error:.4f}")
        print(f"checkpoint in the store: {store.get_run_path(keras_model.getRunId())}")
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
