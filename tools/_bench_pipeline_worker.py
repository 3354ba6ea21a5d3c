"""One rank of the pipeline benchmark (tools/bench/pipeline.py): ``_bench_pipeline_worker.py '<json config>'``."""
import json
import sys

from tools.bench.pipeline import worker

if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
