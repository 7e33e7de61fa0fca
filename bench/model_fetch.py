"""What fetching a model from an object store costs (issue 20 point 6): a moto S3 server on
127.0.0.1, the model uploaded once, then ``triple.model_cache.fetch`` timed in its three uses:

- first: a cold cache (download, hash, atomic rename), as a worker's first load or a launcher's;
- cached (worker): the entry is there; it is hashed again before use;
- cached (launcher): the same, plus one HEAD a file to revalidate it against the store.

Not part of the test suite. Usage::

    .venv/bin/python bench/model_fetch.py MODEL.onnx [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = Path(tempfile.mkdtemp(prefix="model-fetch-bench-"))
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        import fsspec

        from batchinfer.triple.contract import model_digest
        from batchinfer.triple.model_cache import fetch

        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.call_s3("create_bucket", Bucket="bench")
        for file in [args.model, *args.model.parent.glob(f"{args.model.stem}*.data")]:
            fs.pipe_file(f"bench/models/{file.name}", file.read_bytes())
        url = f"s3://bench/models/{args.model.name}"
        size = args.model.stat().st_size
        times: dict[str, list[float]] = {"first": [], "cached (worker)": [], "cached (launcher)": [],
                                         "hash only": []}
        for i in range(args.rounds):
            root = work / f"cache-{i}"
            t0 = time.perf_counter()
            got = fetch(url, None, root)
            times["first"].append(time.perf_counter() - t0)
            assert got.downloaded
            t0 = time.perf_counter()
            assert not fetch(url, got.digest, root).downloaded
            times["cached (worker)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert not fetch(url, got.digest, root, revalidate=True).downloaded
            times["cached (launcher)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model_digest(got.path)
            times["hash only"].append(time.perf_counter() - t0)
            shutil.rmtree(root)
        print(f"{args.model.name}: {size:,} bytes, moto S3 on 127.0.0.1, {args.rounds} rounds (median, min-max)")
        for what, values in times.items():
            print(f"  {what:<18} {statistics.median(values) * 1000:8.1f} ms  "
                  f"({min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
