"""Self-consistency: five sampled answers from forks of one question, then a majority vote.

    moemesh up --model DIR            # in another terminal
    python examples/self_consistency.py --target 127.0.0.1:50051

The five forks share the question's prefix (prefilled once) and generate
side by side; each answer is constrained to a number, and the vote is a
bound tool over the five answers.
"""

import argparse
import collections

import moemesh


def vote(**answers: str) -> str:
    """The most common answer (the first one seen among equals)."""
    return collections.Counter(answers.values()).most_common(1)[0][0]


@moemesh.function
def consistent(s, question: str, num_samples: int = 5):
    s += moemesh.user(question + " Answer with a number only.")
    forks = s.fork(num_samples)
    for i, fork in enumerate(forks):
        fork += moemesh.assistant(moemesh.gen("answer", max_tokens=8, regex="[0-9]{1,4}", temperature=0.8, seed=i))
    s += moemesh.bind(vote, **{f"sample{i}": fork.ref("answer") for i, fork in enumerate(forks)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the gateway's gRPC address")
    parser.add_argument("--question", default="A shop sells 3 boxes of 12 pens. How many pens is that?")
    args = parser.parse_args()
    state = consistent.run(args.question, runtime=moemesh.Runtime(args.target))
    print("majority answer:", state["vote"])


if __name__ == "__main__":
    main()
