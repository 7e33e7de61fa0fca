#!/usr/bin/env python3
"""PySpark 4 as its docs write batch inference: ``spark.read.parquet`` ->
``pyspark.ml.functions.predict_batch_udf`` (ONNX Runtime loaded once per Python worker by
``make_predict_fn``) -> ``write.parquet``, on ``local[2]``, Arrow on.

  peer_spark.py DATA_GLOB MODEL.onnx OUT_DIR [--batch 65536] [--master local[2]]

The feature columns ``f0..`` are combined into one tensor column with ``array()`` and reshaped
by ``input_tensor_shapes=[[F]]``, as the docs' "multiple scalar columns" example does for a
model with one input; writes ``id`` + ``score`` (float). ``predict_batch_udf`` cuts each Arrow
batch into ``batch_size`` rows, and Arrow batches are ``maxRecordsPerBatch`` rows (10,000 by
default), so both are set to ``--batch`` (the floor's 65,536) for the same model calls as the
other programs. ``spark.sql.execution.arrow.pyspark.enabled`` as the Arrow guide says (pandas
UDFs use Arrow regardless). The UI is off; Spark's own start-up (a JVM) is in the wall time.
Needs Java 17+ (Debian's ``openjdk-17-jre-headless``).
See https://spark.apache.org/docs/latest/api/python/reference/api/pyspark.ml.functions.predict_batch_udf.html
and https://spark.apache.org/docs/latest/api/python/tutorial/sql/arrow_pandas.html
"""
import argparse
import glob
import os
import sys
import time

t0 = time.perf_counter()
ap = argparse.ArgumentParser()
ap.add_argument("data")
ap.add_argument("model")
ap.add_argument("out")
ap.add_argument("--batch", type=int, default=65536)
ap.add_argument("--master", default="local[2]")
ap.add_argument("--driver-memory", default="2g", help="the one JVM's heap (local mode)")
a = ap.parse_args()

# The Python workers run this interpreter (the one with onnxruntime), not whatever `python3` is.
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")   # local[2]: nothing listens beyond loopback

import numpy as np  # noqa: E402
from pyspark.ml.functions import predict_batch_udf  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql.functions import array, col  # noqa: E402
from pyspark.sql.types import FloatType  # noqa: E402

spark = (SparkSession.builder.master(a.master).appName("batchinfer-bench-peer")
         .config("spark.driver.memory", a.driver_memory)
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.execution.arrow.pyspark.enabled", "true")
         .config("spark.sql.execution.arrow.maxRecordsPerBatch", str(a.batch))
         .getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
print(f"spark session up after {time.perf_counter() - t0:.2f} s", flush=True)
MODEL = a.model


def make_predict_fn():
    import onnxruntime as ort

    session = ort.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def predict(inputs: np.ndarray) -> np.ndarray:
        return session.run(None, {name: inputs.astype(np.float32, copy=False)})[0][:, 0]

    return predict


files = sorted(glob.glob(a.data))
df = spark.read.parquet(*files)
features = [c for c in df.columns if c.startswith("f")]
score = predict_batch_udf(make_predict_fn, return_type=FloatType(), batch_size=a.batch,
                          input_tensor_shapes=[[len(features)]])
df.select("id", score(array(*[col(c) for c in features])).alias("score")).write.parquet(a.out)
spark.stop()
print(f"spark files={len(files)} seconds={time.perf_counter() - t0:.2f}")
