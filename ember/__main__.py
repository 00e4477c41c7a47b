"""python -m ember demo: the seed tutorial's models compiled on the best device present, checked against eager.
python -m ember minify DIR [OUT]: shrink a saved repro (EMBER_REPRO_DIR) to a small script that still fails."""
import sys

USAGE = "usage: python -m ember demo | python -m ember minify DIR [OUT]"


def main(argv: list[str]) -> int:
    if argv and argv[0] == "demo":
        from ember.demo import main as demo
        return demo(argv[1:])
    if argv and argv[0] == "minify" and len(argv) in (2, 3):
        from ember.tools.minify import minify
        out = minify(argv[1], argv[2] if len(argv) == 3 else None)
        print(f"minified repro: {out / 'repro.py'} (run it: python {out / 'repro.py'})")
        return 0
    print(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
