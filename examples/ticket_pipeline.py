"""A support-ticket pipeline as a moemesh program: classify, extract, call the payment API, answer.

    moemesh up --model DIR            # in another terminal
    python examples/ticket_pipeline.py --target 127.0.0.1:50051 --api-delay 0.3

Classification (`select`) and extraction (`gen` with a JSON schema) are two
forks of the ticket, so they run at the same time and share its prefix in the
cache; the payment API (a stand-in that sleeps `--api-delay` seconds) starts
as soon as the order id is complete in the extraction's stream, while the
other fields are still generated; the answer waits for the category and the
payment record.
"""

import argparse
import json
import time

import moemesh

CATEGORIES = ("billing", "shipping", "account", "other")
FIELDS_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "customer": {"type": "string", "maxLength": 24},
        "urgent": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "urgent"],
    "additionalProperties": False,
}
TICKETS = (
    "Hi, I was charged twice for order 48213. Please refund one of them. - Dana",
    "My parcel for order 1177 has not arrived after three weeks. Sam",
    "I cannot log in to my account since yesterday, order 90210 is stuck. Lee",
)


def payment_status(order_id: int, delay: float) -> dict:
    """Stands in for an internal payment API: a blocking HTTP call of `delay` seconds."""
    time.sleep(delay)
    return {"order_id": order_id, "status": "refund pending" if order_id % 2 else "paid"}


@moemesh.function
def ticket(s, text: str, api_delay: float = 0.3, max_answer_tokens: int = 48, fixed_answer: bool = False):
    """fixed_answer: the answer is exactly max_answer_tokens long (for benchmarks that compare equal work)."""
    s += moemesh.system("You are a support agent. Be brief and polite.")
    s += moemesh.user(text)
    classify, extract = s.fork(2)
    classify += moemesh.assistant("Category: ", moemesh.select("category", CATEGORIES))
    extract += moemesh.assistant(moemesh.gen("fields", max_tokens=96, json_schema=FIELDS_SCHEMA))
    payment = moemesh.bind(payment_status, order_id=extract.ref("fields")["order_id"], delay=api_delay)
    s += moemesh.user("Category: ", classify.ref("category"), "\nPayment record: ", payment,
                      "\nWrite the answer to the customer.")
    s += moemesh.assistant(moemesh.gen("answer", max_tokens=max_answer_tokens, ignore_eos=fixed_answer))
    # For the caller: the fork's values as variables of the returned state.
    s += moemesh.bind(summary, category=classify.ref("category"), fields=extract.ref("fields"))


def summary(category: str, fields: dict) -> dict:
    return {"category": category, **fields}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="the gateway's gRPC address")
    parser.add_argument("--api-delay", type=float, default=0.3, help="seconds the payment API takes")
    args = parser.parse_args()
    runtime = moemesh.Runtime(args.target)
    start = time.monotonic()
    states = ticket.run_batch([{"text": t, "api_delay": args.api_delay} for t in TICKETS], runtime=runtime,
                              max_concurrency=len(TICKETS), progress=True)
    for state in states:
        print(json.dumps({**state["summary"], "payment": state["payment_status"], "answer": state["answer"]}))
    print(f"{len(states)} tickets in {time.monotonic() - start:.2f} s")


if __name__ == "__main__":
    main()
