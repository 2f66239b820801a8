"""LLM programs: `gen`, `select`, `fork` and bound tool calls, run as a DAG over the mesh.

    @moemesh.function
    def ticket(s, text):
        s += moemesh.user(text)
        s += moemesh.assistant(moemesh.gen("answer", max_tokens=64))

    state = ticket.run(text="...", runtime=moemesh.Runtime("127.0.0.1:50051"))
    print(state["answer"])

lang.py holds what a program is written with (the expressions and the
decorator), state.py the program state `s`, runtime.py the execution: every
expression becomes a node on an event loop that starts as soon as its inputs
are ready, speaking to the gateway through `moemesh.AsyncClient`.
"""
