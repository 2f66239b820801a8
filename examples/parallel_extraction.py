"""Multi-field extraction: each field of a record generated in its own fork, all at the same time.

    moemesh up --model DIR            # in another terminal
    python examples/parallel_extraction.py --target 127.0.0.1:50051

Written one after another, each field would wait for the previous one; as
forks of the document they are independent nodes of the program's DAG, so
their requests run together and share the document's prefix in the cache.
"""

import argparse
import json

import moemesh

DOCUMENT = ("Invoice 2231 from Northwind Traders, dated 2026-03-14, for 14 chairs at 35.50 each, "
            "to be paid by bank transfer within 30 days.")
# Field -> the constraint of its gen.
FIELDS = {
    "invoice_number": dict(regex="[0-9]{1,8}"),
    "date": dict(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    "quantity": dict(regex="[0-9]{1,4}"),
    "payment_method": dict(choices=["bank transfer", "credit card", "cash", "cheque"]),
    "vendor": dict(regex="[A-Z][A-Za-z ]{0,30}"),
}


def record(**fields: str) -> dict:
    return fields


@moemesh.function
def extract(s, document: str):
    s += moemesh.user("Document: " + document)
    forks = s.fork(len(FIELDS))
    for fork, (field, constraint) in zip(forks, FIELDS.items()):
        fork += moemesh.assistant(f"{field}: ", moemesh.gen(field, max_tokens=16, **constraint))
    s += moemesh.bind(record, **{field: fork.ref(field) for fork, field in zip(forks, FIELDS)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the gateway's gRPC address")
    args = parser.parse_args()
    state = extract.run(DOCUMENT, runtime=moemesh.Runtime(args.target))
    print(json.dumps(state["record"], indent=2))


if __name__ == "__main__":
    main()
