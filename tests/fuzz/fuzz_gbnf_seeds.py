#!/usr/bin/env python3
"""Writes seed inputs for fuzz_gbnf: llama.cpp-style grammars (literals, classes, groups, every
quantifier, comments, multi-line alternatives) and a few broken ones."""
import os
import sys

out = sys.argv[1]
seeds = [
    'root ::= "yes" | "no"\n',
    'root ::= greet (" " name)? "!"{1,3}\ngreet ::= "hi" | "hello"  # comment\nname ::= [A-Z] [a-z]*\n',
    'root ::= (\n  "a"\n  | "b"\n)+ [^\\x00-\\x1f"]* .\n',
    'root ::= value\nvalue ::= "[" (value ("," value)*)? "]" | [0-9]+\n',
    'root ::= "\\u00e9\\U0001F600" [\\u0100-\\uffff]{2,} "\\"" "\\\\"\n',
    'root ::= x{0,5} y{3} z{2,}\nx ::= "x"\ny ::= "y"\nz ::= "z"\n',
    'root ::= root "a" | "b"\n',
    'root ::= "a" root\n',
    'root ::= undefined\n',
    'root ::= [b-a]\n',
]
for i, s in enumerate(seeds):
    with open(os.path.join(out, f"seed-{i}.gbnf"), "w") as f:
        f.write(s)
