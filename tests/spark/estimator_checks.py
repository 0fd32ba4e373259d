"""Shared by the Spark tests: the regression task ``y = X @ W + B`` and its checks (torch and Lightning
estimators), and :func:`run_example` (the examples run on a module's session)."""

from __future__ import annotations

import numpy as np

W, B = np.array([1.5, -2.0, 0.5]), 0.3


def regression_frame(spark, rows: int = 320):
    """``id``, ``features`` (a 3-vector), ``y = features @ W + B`` and ``is_val`` (every fifth row)."""
    from pyspark.ml.linalg import Vectors

    x = np.random.default_rng(0).normal(size=(rows, 3))
    data = [(i, Vectors.dense(v.tolist()), float(t), i % 5 == 0) for i, (v, t) in enumerate(zip(x, x @ W + B))]
    return spark.createDataFrame(data, ["id", "features", "y", "is_val"])


def check_regression(torch_model, df, module, weight, bias) -> None:
    """The learned parameters within 0.02 of the answer; ``transform``, row by row, equal to ``module`` run here
    in one process and within 0.05 of the answer."""
    import torch

    np.testing.assert_allclose(weight.detach().numpy().ravel(), W, atol=0.02)
    np.testing.assert_allclose(bias.detach().numpy(), [B], atol=0.02)
    out = torch_model.transform(df.select("id", "features"))
    assert out.columns == ["id", "features", "y__output"]
    rows = out.orderBy("id").collect()
    assert len(rows) == df.count()
    x = np.stack([r["features"].toArray() for r in rows])
    with torch.no_grad():
        local = module(torch.from_numpy(x).float()).numpy().ravel()
    predicted = np.array([r["y__output"] for r in rows])
    np.testing.assert_allclose(predicted, local, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(predicted, x @ W + B, atol=0.05)


def run_example(path: str, args: list[str], monkeypatch, capsys) -> str:
    """Run an example script's ``__main__`` in this process, on the module's running Spark session; returns
    what it printed.  The script builds its session with ``getOrCreate()`` (which hands it this one: a second
    JVM and the frameworks' imports cost ~15 s per example here) and stops it when done, which is left to the
    module's fixture."""
    import runpy
    import sys

    from pyspark.sql import SparkSession

    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setattr(SparkSession, "stop", lambda self: None)
    capsys.readouterr()
    runpy.run_path(path, run_name="__main__")
    return capsys.readouterr().out
