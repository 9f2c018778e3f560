"""Python-knowledge items of the offline task set, written by hand for this project (Apache-2.0).

Facts about the language a reader of Python code meets in a first tutorial: keywords,
builtins, literals, syntax. Written once and kept whole (no item was dropped for what a
model answered). scripts/make_tasks.py turns each fact into a multiple-choice item (the
answer and three wrong choices of the same kind) and a short-answer item (the accepted
answers: the first is the reference, the others spellings that mean the same).
"""

from __future__ import annotations

# (question, accepted answers, three wrong choices)
PYTHON_FACTS: list[tuple[str, tuple[str, ...], tuple[str, str, str]]] = [
    ("Which keyword defines a function in Python?", ("def",), ("func", "function", "fn")),
    ("Which keyword defines a class in Python?", ("class",), ("struct", "object", "type")),
    ("Which keyword returns a value from a Python function?", ("return",), ("yield", "give", "output")),
    ("Which keyword starts a loop over the items of a list in Python?", ("for",), ("if", "def", "with")),
    ("Which keyword imports a module in Python?", ("import",), ("include", "require", "using")),
    ("Which keyword starts a conditional statement in Python?", ("if",), ("for", "def", "try")),
    ("Which keyword handles an exception in a Python try statement?", ("except",), ("catch", "rescue", "handle")),
    ("Which keyword skips to the next iteration of a Python loop?", ("continue",), ("break", "pass", "next")),
    ("Which keyword leaves a Python loop early?", ("break",), ("continue", "exit", "stop")),
    ("Which keyword does nothing and is used as a placeholder in Python?", ("pass",), ("skip", "null", "void")),
    ("Which keyword creates a small anonymous function in Python?", ("lambda",), ("def", "fn", "func")),
    ("What is the Python value for true?", ("True",), ("true", "1.0", "Yes")),
    ("What is the Python value for false?", ("False",), ("false", "No", "0.0")),
    ("What is the Python value that means no value?", ("None",), ("null", "nil", "undefined")),
    ("Which built-in function prints text in Python?", ("print",), ("echo", "write", "say")),
    ("Which built-in function gives the length of a list in Python?", ("len",), ("size", "length", "count")),
    ("Which built-in function reads a line typed by the user in Python?", ("input",), ("read", "scan", "get")),
    ("Which built-in function turns a string into an integer in Python?", ("int",), ("str", "float", "list")),
    ("Which built-in function turns a number into a string in Python?", ("str",), ("int", "chr", "len")),
    ("Which built-in function gives a sequence of numbers for a loop in Python?", ("range",), ("list", "seq", "len")),
    ("Which built-in function opens a file in Python?", ("open",), ("file", "read", "load")),
    ("Which built-in function sorts a list into a new list in Python?", ("sorted",), ("order", "sort", "arrange")),
    ("Which built-in function adds up the numbers of a list in Python?", ("sum",), ("add", "total", "plus")),
    ("Which built-in function gives the largest item of a list in Python?", ("max",), ("min", "top", "big")),
    ("Which built-in function gives the smallest item of a list in Python?", ("min",), ("max", "low", "small")),
    ("Which built-in function gives the type of a value in Python?", ("type",), ("kind", "class", "typeof")),
    ("Which list method adds an item at the end of a Python list?", ("append",), ("push", "add", "insert")),
    ("Which list method removes and returns the last item of a Python list?", ("pop",), ("push", "take", "cut")),
    ("Which string method makes every letter uppercase in Python?", ("upper",), ("lower", "title", "strip")),
    ("Which string method makes every letter lowercase in Python?", ("lower",), ("upper", "title", "split")),
    ("Which string method splits a string into a list of words in Python?", ("split",), ("join", "strip", "cut")),
    ("Which string method removes spaces from both ends of a string in Python?", ("strip",), ("split", "trim", "cut")),
    ("Which dictionary method gives the keys of a Python dictionary?", ("keys",), ("values", "items", "names")),
    ("What character starts a comment in Python?", ("#",), ("//", "--", "%")),
    ("What file extension do Python source files have?", (".py", "py"), (".js", ".java", ".txt")),
    ("What brackets make a list in Python?", ("square brackets", "[]"), ("curly braces", "angle brackets", "bars")),
    (
        "What brackets make a dictionary in Python?",
        ("curly braces", "{}"),
        ("square brackets", "angle brackets", "bars"),
    ),  # noqa: E501
    ("What operator raises a number to a power in Python?", ("**",), ("^", "//", "%")),
    ("What operator gives the remainder of a division in Python?", ("%",), ("/", "//", "**")),
    ("What operator tests whether two values are equal in Python?", ("==",), ("=", "!=", "<>")),
    ("What operator tests whether two values are not equal in Python?", ("!=",), ("==", "=/=", "<")),
    ("What is the index of the first item of a Python list?", ("0", "zero"), ("1", "-1", "2")),
    ("What is the index of the last item of a Python list, counted from the end?", ("-1",), ("0", "1", "-0")),
    ("What does Python use to mark a block of code?", ("indentation",), ("braces", "semicolons", "brackets")),
    ("What is the name of the Python package installer?", ("pip",), ("npm", "apt", "gem")),
    ("What kind of value is 3.5 in Python?", ("float",), ("int", "str", "list")),
    ("What kind of value is 'hello' in Python?", ("str", "string"), ("int", "float", "bool")),
    ("What kind of value is 7 in Python?", ("int", "integer"), ("float", "str", "bool")),
    ("What kind of value is True in Python?", ("bool", "boolean"), ("int", "str", "float")),
    ("What kind of value is [1, 2, 3] in Python?", ("list",), ("dict", "set", "str")),
]
