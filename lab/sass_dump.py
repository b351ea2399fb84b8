"""pytest plugin (`-p sass_dump`, lab/ on PYTHONPATH): every sm90.build a test makes is disassembled (cuobjdump -sass) and its SASS, addresses and headers stripped, hashed into the JSON lines file $SASS_DUMP; compare two runs to tell whether a change moved any kernel build."""
import hashlib, json, os, re, subprocess, tempfile
from pathlib import Path

def pytest_configure(config):
    import triton
    from onepath.ops.cuda import sm90
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    orig = sm90.build
    def build(kernel, sig, consts, aligned, *a, **k):
        c = orig(kernel, sig, consts, aligned, *a, **k)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"]); f.flush()
            sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True).stdout
        body = []
        for line in sass.splitlines():
            s = line.strip()
            if not s or s.startswith(("code for", "Function", ".headerflags", "Fatbin", "=", "arch", "code version", "host", "compile_size", "identifier")):
                continue
            body.append(re.sub(r"/\*[0-9a-f]{4,}\*/", "", s).strip())
        fn = getattr(kernel, "fn", kernel)
        rec = {"kernel": getattr(fn, "__name__", str(fn)), "consts": repr(sorted((str(x), repr(y)) for x, y in consts.items())),
               "sig": repr(sorted(sig.items())), "args": repr(a) + repr(sorted(k.items())), "sass": hashlib.sha256("\n".join(body).encode()).hexdigest(),
               "lines": len(body), "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
        with open(os.environ["SASS_DUMP"], "a") as out:
            out.write(json.dumps(rec) + "\n")
        return c
    sm90.build = build
