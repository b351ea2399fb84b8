"""The test harness tasks/code.py runs in the sandbox, as main.py beside solution.py and tests.json.

Standard library only, any Python 3.8+ (the sandbox may run the system's interpreter). tests.json is
one of: {"kind": "call", "fn_name", "inputs": [[args]], "outputs": [value]} (call the function,
compare the JSON of what it returns, so an object that claims to equal anything does not pass);
{"kind": "stdio", "inputs": [text], "outputs": [text]} (run the program on stdin, compare stdout
line by line, trailing spaces and blank lines ignored); {"kind": "assert", "tests": [statement]}.

It writes one JSON line per test to the pipe whose fd is its last argument, as each test ends
({"test": i, "passed": bool, "error": str}), so tests finished before a timeout still count; or one
{"load_error": str} if the solution cannot even be loaded. Each line carries the nonce it read from
stdin before the solution ran.
"""
import contextlib
import io
import json
import os
import sys

MAX_MESSAGE = 200


def canonical(value) -> str:
    return json.dumps(value, sort_keys=True)  # tuples read as lists; anything but plain data raises


def shown(value) -> str:
    try:
        return repr(value)[:80]
    except BaseException:  # noqa: BLE001 - a hostile __repr__
        return "<unprintable>"


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {shown(e)[:MAX_MESSAGE]}"


def normalised(text: str) -> list:
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def call(name: str, args: list) -> str:
    return f"{name}({', '.join(shown(a) for a in args)})"


def call_test(fn, name: str, args: list, expected):
    try:
        got = fn(*args)
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the solution's failures too
        return False, f"{call(name, args)} raised {failure(e)}"
    try:
        if canonical(got) == canonical(expected):
            return True, None
    except BaseException:  # noqa: BLE001 - not plain data
        pass
    return False, f"{call(name, args)} returned {shown(got)}, expected {shown(expected)}"


def stdio_test(code, text: str, expected: str):
    out = io.StringIO()
    stdin = sys.stdin
    sys.stdin = io.StringIO(text)
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__main__"})
    except SystemExit as e:
        if e.code not in (None, 0):
            return False, f"exit code {shown(e.code)} on input {shown(text)}"
    except BaseException as e:  # noqa: BLE001
        return False, f"raised {failure(e)} on input {shown(text)}"
    finally:
        sys.stdin = stdin
    if normalised(out.getvalue()) == normalised(expected):
        return True, None
    return False, f"printed {shown(out.getvalue())} on input {shown(text)}, expected {shown(expected)}"


def assert_test(namespace: dict, statement: str):
    try:
        exec(compile(statement, "<test>", "exec"), namespace)
        return True, None
    except BaseException as e:  # noqa: BLE001
        return False, f"{statement[:MAX_MESSAGE]} failed: {failure(e)}"


def main():
    channel, nonce = int(sys.argv[-1]), sys.stdin.readline().strip()
    sys.stdin = io.StringIO()  # the solution reads an empty stdin, not the nonce

    def send(record: dict):
        os.write(channel, (json.dumps({"nonce": nonce, **record}) + "\n").encode())

    with open("tests.json") as f:
        spec = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except BaseException as e:  # noqa: BLE001 - SyntaxError, MemoryError, RecursionError
        send({"load_error": failure(e)})
        return
    if spec["kind"] == "stdio":
        for i, (text, expected) in enumerate(zip(spec["inputs"], spec["outputs"])):
            passed, error = stdio_test(code, text, expected)
            send({"test": i, "passed": passed, "error": error})
        return
    namespace = {"__name__": "solution"}
    try:
        exec(code, namespace)
    except BaseException as e:  # noqa: BLE001
        send({"load_error": failure(e)})
        return
    if spec["kind"] == "assert":
        tests = [(assert_test, (namespace, statement)) for statement in spec["tests"]]
    else:
        fn = namespace.get(spec["fn_name"])
        if not callable(fn):
            send({"load_error": f"the solution defines no function {spec['fn_name']}"})
            return
        tests = [(call_test, (fn, spec["fn_name"], args, expected))
                 for args, expected in zip(spec["inputs"], spec["outputs"])]
    for i, (test, args) in enumerate(tests):
        passed, error = test(*args)
        send({"test": i, "passed": passed, "error": error})


if __name__ == "__main__":
    main()
