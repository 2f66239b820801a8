"""The fixed prompt set: expert hit statistics and sample generations are measured on it.

Chat prompts are rendered as moemesh's gateway renders a user message (ChatML
with the assistant's generation prompt), so the router statistics of a served
request over the same prompts count the same tokens.
"""

PLAIN_PROMPTS = (
    "Hello, world!",
    "The history of the city begins in the middle ages, when",
    "A database is an organized collection of data. The most common kind",
    "Python is a programming language that lets you work quickly and",
    "Once upon a time, a programmer was asked to fix a bug that",
    "To create a new table in the database, use the CREATE TABLE command, which",
    "The function returns a list of strings, one for each line of the file. If the file is empty,",
    "In this tutorial, we will build a small web application that",
    "The weather was cold and the road was long, but the travellers",
    "Every object has an identity, a type and a value. The identity of an object",
    "When the server starts, it reads its configuration file and",
    "The committee met on Tuesday to discuss the new rules for the library, and",
    "An index makes queries faster because",
    "She opened the old book and read the first page aloud:",
    "The following example shows how to open a file, read its contents and",
    "A good teacher knows that the best way to learn something is",
)
CHAT_PROMPTS = (
    "What does \"happiness\" mean?",
    "Tell me about lists.",
    "Tell me a fortune.",
    "What does \"kludge\" mean in hacker slang?",
    "What is a database index?",
    "Give me a synonym of \"quick\".",
    "Say something wise.",
    "How do I read a file in Python?",
    "What does \"river\" mean?",
    "Tell me about transactions.",
    "Tell me something funny.",
    "What does the Devil's Dictionary say about \"lawyer\"?",
    "Give me a quote.",
    "What does \"to borrow\" mean?",
    "Tell me about the SELECT command.",
    "Can you explain what a function is?",
)


def chat_text(user_message: str) -> str:
    """The ChatML text a served chat request with this user message starts from."""
    from services.tokenizer import IM_END, IM_START

    return f"{IM_START}user\n{user_message}{IM_END}\n{IM_START}assistant\n"


def all_prompts() -> list[dict]:
    """Every prompt as {"kind", "text"}: the user-facing text, and for chat the message."""
    return ([{"kind": "plain", "text": p, "model_text": p} for p in PLAIN_PROMPTS]
            + [{"kind": "chat", "text": m, "model_text": chat_text(m)} for m in CHAT_PROMPTS])
