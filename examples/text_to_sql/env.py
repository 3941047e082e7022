"""Text-to-SQL: questions about a small company database, answered with a query.

The database (employees, departments) is generated from a seed. The agent may
explore it with the `run_sql` tool; its final answer is one SELECT query, and
the reward is 1.0 when that query's result equals the gold query's result on
the tool's database and on hidden check databases (same schema and names,
other values), else 0.0. Every query runs read-only, under an authorizer that
allows reading only, and with a time limit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.parse
import weakref

from ac2_jax.envs import Env, Task, Tool, run_tool
from ac2_jax.seeds import hashed_seed
from examples._sync import run_sync

DEPTS = ("Sales", "Research", "Engineering", "Marketing", "Support", "Finance")
NAMES = (
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
    "Karl", "Laura", "Mallory", "Nina", "Oscar", "Peggy", "Quentin", "Rita", "Sam", "Trudy",
    "Uma", "Victor", "Wendy", "Xavier", "Yara", "Zack", "Amir", "Bea", "Chen", "Dana",
)  # fmt: skip
SCHEMA = (
    "CREATE TABLE departments (name TEXT PRIMARY KEY, floor INTEGER NOT NULL);\n"
    "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT NOT NULL, dept TEXT NOT NULL "
    "REFERENCES departments(name), salary INTEGER NOT NULL, hired_year INTEGER NOT NULL);"
)
_YEARS = range(2008, 2024)

# (template id, question, gold SQL, hint, parameter sets)
_TEMPLATES = (
    ("count_dept", "How many employees work in {dept}?",
     "SELECT COUNT(*) FROM employees WHERE dept = '{dept}'",
     "Count rows with COUNT(*) and filter with WHERE dept = '{dept}'.",
     [{"dept": d} for d in DEPTS]),
    ("top_paid", "What is the name of the highest-paid employee in {dept}?",
     "SELECT name FROM employees WHERE dept = '{dept}' ORDER BY salary DESC LIMIT 1",
     "Filter with WHERE dept = '{dept}', then ORDER BY salary DESC LIMIT 1.",
     [{"dept": d} for d in DEPTS]),
    ("total_salary", "What is the total salary of the employees in {dept}?",
     "SELECT SUM(salary) FROM employees WHERE dept = '{dept}'",
     "Use SUM(salary) with WHERE dept = '{dept}'.",
     [{"dept": d} for d in DEPTS]),
    ("avg_after", "What is the average salary of employees hired after {year}, "
     "rounded to an integer?",
     "SELECT ROUND(AVG(salary)) FROM employees WHERE hired_year > {year}",
     "Use ROUND(AVG(salary)) with WHERE hired_year > {year}.",
     [{"year": y} for y in range(2010, 2021)]),
    ("hired_in", "How many employees were hired in {year}?",
     "SELECT COUNT(*) FROM employees WHERE hired_year = {year}",
     "Use COUNT(*) with WHERE hired_year = {year}.",
     [{"year": y} for y in _YEARS]),
    ("floor_names", "List the names of the employees who work on floor {floor}.",
     "SELECT e.name FROM employees e JOIN departments d ON e.dept = d.name "
     "WHERE d.floor = {floor}",
     "JOIN employees with departments ON employees.dept = departments.name, "
     "then WHERE departments.floor = {floor}.",
     [{"floor": f} for f in range(1, 5)]),
    ("earn_above", "List the names of the employees who earn more than {amount}, "
     "highest salary first.",
     "SELECT name FROM employees WHERE salary > {amount} ORDER BY salary DESC",
     "Filter with WHERE salary > {amount} and sort with ORDER BY salary DESC.",
     [{"amount": a} for a in range(60000, 140001, 10000)]),
    ("per_dept", "How many employees does each department have? Return one row per "
     "department: its name and the count.",
     "SELECT dept, COUNT(*) FROM employees GROUP BY dept",
     "SELECT dept, COUNT(*) ... GROUP BY dept.",
     [{}]),
    ("dept_before", "List the names of the employees in {dept} hired before {year}.",
     "SELECT name FROM employees WHERE dept = '{dept}' AND hired_year < {year}",
     "Combine both filters: WHERE dept = '{dept}' AND hired_year < {year}.",
     [{"dept": d, "year": y} for d in DEPTS for y in range(2012, 2021, 2)]),
    ("above_dept_avg", "How many employees earn more than the average salary in {dept}?",
     "SELECT COUNT(*) FROM employees WHERE salary > "
     "(SELECT AVG(salary) FROM employees WHERE dept = '{dept}')",
     "Compare salary with a subquery: (SELECT AVG(salary) FROM employees "
     "WHERE dept = '{dept}').",
     [{"dept": d} for d in DEPTS]),
    ("floor_of", "On which floor does {person} work?",
     "SELECT d.floor FROM employees e JOIN departments d ON e.dept = d.name "
     "WHERE e.name = '{person}'",
     "JOIN employees with departments on the department name, then filter on e.name.",
     [{"person": p} for p in NAMES]),
)  # fmt: skip

_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_ALLOWED.add(getattr(sqlite3, "SQLITE_RECURSIVE", 33))
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info"}


def build_db(path: str, seed: int) -> None:
    """Writes the database of `seed` to `path`: 6 departments, 30 employees
    (fixed names, every department has at least two, salaries all different)."""
    rng = random.Random(f"text_to_sql-db:{seed}")
    floors = [(d, rng.randint(1, 4)) for d in DEPTS]
    depts = list(DEPTS) * 2 + [rng.choice(DEPTS) for _ in range(len(NAMES) - 2 * len(DEPTS))]
    rng.shuffle(depts)
    salaries = rng.sample(range(40, 151), len(NAMES))
    rows = [
        (i + 1, name, depts[i], salaries[i] * 1000, rng.choice(_YEARS))
        for i, name in enumerate(NAMES)
    ]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(SCHEMA)
        conn.executemany("INSERT INTO departments VALUES (?, ?)", floors)
        conn.executemany("INSERT INTO employees VALUES (?, ?, ?, ?, ?)", rows)
        conn.commit()


def _authorize(action, arg1, arg2, db, trigger):
    if action in _ALLOWED:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and arg1 in _READ_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def query_db(path: str, sql: str, max_rows: int, timeout_s: float):
    """Runs `sql` read-only on the db at `path`: (column names, up to `max_rows`
    rows, whether more rows were left). Raises on any error or the time limit."""
    if len(sql) > 4000:
        raise ValueError("query longer than 4000 characters")
    uri = f"file:{urllib.parse.quote(path)}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, check_same_thread=False)) as conn:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 1_000_000)
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.set_authorizer(_authorize)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            cur = conn.execute(sql)
            rows = cur.fetchmany(max_rows + 1)
        except sqlite3.OperationalError as e:
            if str(e) == "interrupted":
                raise TimeoutError(f"query ran past {timeout_s:g}s") from None
            raise
        columns = [c[0] for c in cur.description or ()]
    return columns, rows[:max_rows], len(rows) > max_rows


def extract_sql(text: str | None) -> str:
    """The SQL of an answer: the last ``` fence's body (```sql or bare), else the
    whole text; stripped, trailing semicolons dropped."""
    found = _FENCE.findall(text or "")
    sql = found[-1] if found else (text or "")
    return sql.strip().rstrip(";").strip()


def _format(columns, rows, more: bool, max_rows: int) -> str:
    lines = [" | ".join(columns)]
    lines += [" | ".join("NULL" if v is None else str(v) for v in row) for row in rows]
    tail = f"(more than {max_rows} rows; {max_rows} shown)" if more else f"({len(rows)} rows)"
    return "\n".join(lines + [tail])


class TextToSQLEnv(Env):
    """Questions about a generated sqlite db; the answer is a SELECT query."""

    name = "text_to_sql"
    reward_range = (0.0, 1.0)
    system_prompt = (
        "You answer questions about a SQLite database with this schema:\n"
        f"{SCHEMA}\n"
        "Use the run_sql tool to run read-only queries and look at the data. "
        "Your final answer is one SQL SELECT query that returns exactly the rows that "
        "answer the question (column names do not matter; row order matters only when "
        "the question asks for one). Reply with the query alone, in a ```sql block."
    )

    def __init__(
        self,
        db_seed: int = 0,
        check_dbs: int = 2,
        max_rows: int = 20,
        query_timeout_s: float = 2.0,
    ):
        self.db_seed, self.check_dbs = db_seed, check_dbs
        self.max_rows, self.query_timeout_s = max_rows, query_timeout_s
        self._lock = threading.Lock()
        self._dir: str | None = None
        self._gold: dict[tuple[int, str], list] = {}
        self._instances: list[dict] | None = None

    def __getstate__(self):
        state = dict(self.__dict__, _lock=None, _dir=None, _gold={})
        state.pop("_finalizer", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def db_paths(self) -> list[str]:
        """The tool's database, then the check databases (built on first use)."""
        with self._lock:
            if self._dir is None or not os.path.isdir(self._dir):
                self._dir = tempfile.mkdtemp(prefix="ac2-text-to-sql-")
                self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
                for i in range(1 + self.check_dbs):
                    build_db(os.path.join(self._dir, f"db{i}.sqlite"), self.db_seed + i)
            return [os.path.join(self._dir, f"db{i}.sqlite") for i in range(1 + self.check_dbs)]

    def _gold_rows(self, index: int, gold: str) -> list:
        key = (index, gold)
        if key not in self._gold:
            _, rows, _ = query_db(self.db_paths()[index], gold, 10_000, 10.0)
            self._gold[key] = rows
        return self._gold[key]

    def instances(self) -> list[dict]:
        """Every (template, parameters) task whose gold result on the tool's db is not empty."""
        if self._instances is None:
            found = []
            for tid, question, gold, hint, params in _TEMPLATES:
                for p in params:
                    inst = {
                        "template": tid,
                        "params": p,
                        "question": question.format(**p),
                        "gold": gold.format(**p),
                        "hint": hint.format(**p),
                        "ordered": "ORDER BY" in gold,
                        "key": f"{tid}:{json.dumps(p, sort_keys=True)}",
                    }
                    if self._gold_rows(0, inst["gold"]):
                        found.append(inst)
            self._instances = found
        return self._instances

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        # Each instance belongs to one split by the parity of its key's hash; within
        # a split, a seeded shuffle, cycled (with new ids) when n exceeds the split.
        want = 0 if split == "train" else 1
        pool = [i for i in self.instances() if hashed_seed(self.name, i["key"]) % 2 == want]
        rng = random.Random(hashed_seed(self.name, split, seed))
        tasks: list[Task] = []
        while len(tasks) < n:
            order = pool[:]
            rng.shuffle(order)
            for inst in order[: n - len(tasks)]:
                tasks.append(
                    Task(
                        task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                        prompt=inst["question"],
                        answer=inst["gold"],
                        domain=self.name,
                        metadata={k: inst[k] for k in ("template", "params", "ordered", "key")}
                        | {"hint": inst["hint"]},
                    )
                )
        return tasks

    def run_sql(self, query: str) -> str:
        """The `run_sql` tool: the query's rows as text (errors raise, run_tool reports them)."""
        columns, rows, more = query_db(
            self.db_paths()[0], query, self.max_rows, self.query_timeout_s
        )
        return _format(columns, rows, more, self.max_rows)

    @property
    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="run_sql",
                description=(
                    "Run one read-only SQLite query on the database; returns the column "
                    f"names and up to {self.max_rows} rows."
                ),
                parameters={
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "SQL query"}},
                    "required": ["query"],
                },
                fn=self.run_sql,
                timeout_s=self.query_timeout_s + 3.0,
            )
        ]

    def verify(self, task: Task, answer: str | None) -> float:
        sql = extract_sql(answer)
        if not sql:
            return 0.0
        for index, path in enumerate(self.db_paths()):
            try:
                _, rows, more = query_db(path, sql, 10_000, self.query_timeout_s)
                gold = self._gold_rows(index, task.answer)
            except Exception:  # noqa: BLE001 - an invalid or failing query earns 0
                return 0.0
            if more:
                return 0.0
            if task.metadata.get("ordered"):
                same = [tuple(r) for r in rows] == [tuple(r) for r in gold]
            else:
                same = collections.Counter(rows) == collections.Counter(gold)
            if not same:
                return 0.0
        return 1.0

    def reference_answer(self, task: Task) -> str:
        return f"```sql\n{task.answer}\n```"

    def hint(self, task: Task) -> str:
        return task.metadata["hint"]

    def demonstration(self, task: Task) -> list[dict]:
        """System, question, a run_sql call of the gold query with its real output,
        then the gold query as the answer."""
        args = json.dumps({"query": task.answer})
        output, _ = run_sync(lambda: run_tool(self.tool("run_sql"), args))
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "run_sql", "arguments": args},
        }
        return self.initial_messages(task) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": output},
            {"role": "assistant", "content": self.reference_answer(task)},
        ]
