"""python -m ember demo: the seed tutorial's models compiled on the best device present, checked against eager."""
import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "demo":
        print("usage: python -m ember demo")
        return 2
    from ember.demo import main as demo
    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
