import sys

from .cli import main

# The guard matters: vLLM and multiprocessing start workers by spawn, which re-imports __main__.
if __name__ == "__main__":
    from .deadline import end_process_if_held

    code = main()
    end_process_if_held(code)  # threads user code left running (non-daemon) must not keep a finished run alive
    sys.exit(code)
