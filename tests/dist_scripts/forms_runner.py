"""Run a real-rank job's named forms one after another: each form's returned discrepancy (or None) and seconds, or
the traceback of a form that raised (every rank raises alike, so the next form still pairs its collectives)."""
import time
import traceback


def run_all(forms) -> dict:
    out = {}
    for name, fn in forms.items():
        t = time.time()
        try:
            out[name] = {"err": fn(), "s": round(time.time() - t, 2)}
        except Exception:                         # noqa: BLE001  (a form that raises on every rank alike)
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out
