"""164 correct HumanEval-shaped programs (a function plus ``def check(candidate)``) for the sandbox benchmark.

Eighteen problems in the style of HumanEval (typing imports, loops, string and list work, a few asserts
each), each repeated under a different function name and constant, so no two programs are identical.
"""

_PROBLEMS = [
    ("has_close_elements", '''
from typing import List


def {name}(numbers: List[float], threshold: float) -> bool:
    """Whether any two numbers are closer to each other than threshold."""
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
''', '''
def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([{k}.0, {k}.5], 0.1) == False
'''),
    ("separate_paren_groups", '''
from typing import List


def {name}(paren_string: str) -> List[str]:
    """Split balanced, non-nested-at-top-level groups of parentheses."""
    result, current, depth = [], [], 0
    for c in paren_string:
        if c == "(":
            depth += 1
            current.append(c)
        elif c == ")":
            depth -= 1
            current.append(c)
            if depth == 0:
                result.append("".join(current))
                current = []
    return result
''', '''
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == ['(()())', '((()))', '()', '((())()())']
    assert candidate('() (()) ((())) (((())))') == ['()', '(())', '((()))', '(((())))']
    assert candidate('(()(())((())))') == ['(()(())((())))']
    assert candidate('( ) (( )) (( )( ))') == ['()', '(())', '(()())']
    assert candidate('()' * {k}) == ['()'] * {k}
'''),
    ("below_zero", '''
from typing import List


def {name}(operations: List[int]) -> bool:
    """Whether a running balance starting at zero ever drops below zero."""
    balance = 0
    for op in operations:
        balance += op
        if balance < 0:
            return True
    return False
''', '''
def check(candidate):
    assert candidate([]) == False
    assert candidate([1, 2, -3, 1, 2, -3]) == False
    assert candidate([1, 2, -4, 5, 6]) == True
    assert candidate([1, -1, 2, -2, 5, -5, 4, -4]) == False
    assert candidate([1, -1, 2, -2, 5, -5, 4, -5]) == True
    assert candidate([{k}, -{k}, -1]) == True
'''),
    ("mean_absolute_deviation", '''
from typing import List


def {name}(numbers: List[float]) -> float:
    """Mean absolute deviation around the mean."""
    mean = sum(numbers) / len(numbers)
    return sum(abs(x - mean) for x in numbers) / len(numbers)
''', '''
def check(candidate):
    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0 / 3.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0]) - 1.0) < 1e-6
    assert abs(candidate([1.0, 2.0, 3.0, 4.0, 5.0]) - 6.0 / 5.0) < 1e-6
    assert abs(candidate([{k}.0, {k}.0])) < 1e-6
'''),
    ("parse_nested_parens", '''
from typing import List


def {name}(paren_string: str) -> List[int]:
    """Deepest nesting level of each space-separated group."""
    def depth(group):
        level = deepest = 0
        for c in group:
            level += 1 if c == "(" else -1
            deepest = max(deepest, level)
        return deepest
    return [depth(g) for g in paren_string.split() if g]
''', '''
def check(candidate):
    assert candidate('(()()) ((())) () ((())()())') == [2, 3, 1, 3]
    assert candidate('() (()) ((())) (((())))') == [1, 2, 3, 4]
    assert candidate('(()(())((())))') == [4]
    assert candidate('(' * {k} + ')' * {k}) == [{k}]
'''),
    ("filter_by_substring", '''
from typing import List


def {name}(strings: List[str], substring: str) -> List[str]:
    """The strings that contain substring, in order."""
    return [s for s in strings if substring in s]
''', '''
def check(candidate):
    assert candidate([], 'john') == []
    assert candidate(['xxx', 'asd', 'xxy', 'john doe', 'xxxAAA', 'xxx'], 'xxx') == ['xxx', 'xxxAAA', 'xxx']
    assert candidate(['xxx', 'asd', 'aaaxxy', 'john doe', 'xxxAAA', 'xxx'], 'xx') == ['xxx', 'aaaxxy', 'xxxAAA', 'xxx']
    assert candidate(['grunt', 'trumpet', 'prune', 'gruesome'], 'run') == ['grunt', 'prune']
    assert candidate([str(i) for i in range({k})], '1') == [str(i) for i in range({k}) if '1' in str(i)]
'''),
    ("sum_product", '''
from typing import List, Tuple


def {name}(numbers: List[int]) -> Tuple[int, int]:
    """(sum, product) of a list; (0, 1) for an empty one."""
    total, product = 0, 1
    for n in numbers:
        total += n
        product *= n
    return total, product
''', '''
def check(candidate):
    assert candidate([]) == (0, 1)
    assert candidate([1, 1, 1]) == (3, 1)
    assert candidate([100, 0]) == (100, 0)
    assert candidate([3, 5, 7]) == (3 + 5 + 7, 3 * 5 * 7)
    assert candidate([10]) == (10, 10)
    assert candidate([{k}, 2]) == ({k} + 2, {k} * 2)
'''),
    ("rolling_max", '''
from typing import List


def {name}(numbers: List[int]) -> List[int]:
    """The running maximum of a list."""
    result, best = [], None
    for n in numbers:
        best = n if best is None else max(best, n)
        result.append(best)
    return result
''', '''
def check(candidate):
    assert candidate([]) == []
    assert candidate([1, 2, 3, 4]) == [1, 2, 3, 4]
    assert candidate([4, 3, 2, 1]) == [4, 4, 4, 4]
    assert candidate([3, 2, 3, 100, 3]) == [3, 3, 3, 100, 100]
    assert candidate(list(range({k}, 0, -1))) == [{k}] * {k}
'''),
    ("make_palindrome", '''
def {name}(string: str) -> str:
    """The shortest palindrome that begins with string."""
    if not string:
        return ""
    for start in range(len(string)):
        suffix = string[start:]
        if suffix == suffix[::-1]:
            return string + string[:start][::-1]
    return string
''', '''
def check(candidate):
    assert candidate('') == ''
    assert candidate('x') == 'x'
    assert candidate('xyz') == 'xyzyx'
    assert candidate('xyx') == 'xyx'
    assert candidate('jerry') == 'jerryrrej'
    assert candidate('ab' * {k}) == 'ab' * {k} + 'a'
'''),
    ("string_xor", '''
def {name}(a: str, b: str) -> str:
    """Bitwise XOR of two equal-length strings of 0s and 1s."""
    return "".join("0" if x == y else "1" for x, y in zip(a, b))
''', '''
def check(candidate):
    assert candidate('111000', '101010') == '010010'
    assert candidate('1', '1') == '0'
    assert candidate('0101', '0000') == '0101'
    assert candidate('1' * {k}, '0' * {k}) == '1' * {k}
'''),
    ("longest", '''
from typing import List, Optional


def {name}(strings: List[str]) -> Optional[str]:
    """The first longest string, or None for an empty list."""
    if not strings:
        return None
    longest_length = max(len(s) for s in strings)
    for s in strings:
        if len(s) == longest_length:
            return s
''', '''
def check(candidate):
    assert candidate([]) == None
    assert candidate(['x', 'y', 'z']) == 'x'
    assert candidate(['x', 'yyy', 'zzzz', 'www', 'kkkk', 'abc']) == 'zzzz'
    assert candidate(['a' * {k}, 'b']) == 'a' * {k}
'''),
    ("greatest_common_divisor", '''
def {name}(a: int, b: int) -> int:
    """Greatest common divisor by Euclid's algorithm."""
    while b:
        a, b = b, a % b
    return a
''', '''
def check(candidate):
    assert candidate(3, 7) == 1
    assert candidate(10, 15) == 5
    assert candidate(49, 14) == 7
    assert candidate(144, 60) == 12
    assert candidate({k} * 6, {k} * 4) == {k} * 2
'''),
    ("count_distinct_characters", '''
def {name}(string: str) -> int:
    """Distinct characters, ignoring case."""
    return len(set(string.lower()))
''', '''
def check(candidate):
    assert candidate('') == 0
    assert candidate('abcde') == 5
    assert candidate('abcde' + 'cade' + 'CADE') == 5
    assert candidate('aaaaAAAAaaaa') == 1
    assert candidate('Jerry jERRY JeRRRY') == 5
    assert candidate('ab' * {k}) == 2
'''),
    ("parse_music", '''
from typing import List


def {name}(music_string: str) -> List[int]:
    """Beats per note: 'o' whole (4), 'o|' half (2), '.|' quarter (1)."""
    beats = {{"o": 4, "o|": 2, ".|": 1}}
    return [beats[note] for note in music_string.split() if note]
''', '''
def check(candidate):
    assert candidate('') == []
    assert candidate('o o o o') == [4, 4, 4, 4]
    assert candidate('.| .| .| .|') == [1, 1, 1, 1]
    assert candidate('o| o| .| .| o o o o') == [2, 2, 1, 1, 4, 4, 4, 4]
    assert candidate(' '.join(['o|'] * {k})) == [2] * {k}
'''),
    ("sort_numbers", '''
def {name}(numbers: str) -> str:
    """Sort space-separated number words from 'zero' to 'nine'."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    value = {{w: i for i, w in enumerate(words)}}
    return " ".join(sorted((w for w in numbers.split() if w), key=value.__getitem__))
''', '''
def check(candidate):
    assert candidate('') == ''
    assert candidate('three') == 'three'
    assert candidate('three five nine') == 'three five nine'
    assert candidate('five zero four seven nine eight') == 'zero four five seven eight nine'
    assert candidate('six five four three two one zero') == 'zero one two three four five six'
    assert candidate('one ' * {k}) == ' '.join(['one'] * {k})
'''),
    ("find_closest_elements", '''
from typing import List, Tuple


def {name}(numbers: List[float]) -> Tuple[float, float]:
    """The two closest numbers, smaller first."""
    ordered = sorted(numbers)
    pairs = zip(ordered, ordered[1:])
    return min(pairs, key=lambda p: p[1] - p[0])
''', '''
def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2]) == (3.9, 4.0)
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0]) == (5.0, 5.9)
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.2]) == (2.0, 2.2)
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0]) == (2.0, 2.0)
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1]) == (2.2, 3.1)
    assert candidate([0.0, {k}.0, {k}.5]) == ({k}.0, {k}.5)
'''),
    ("is_prime", '''
import math


def {name}(n: int) -> bool:
    """Whether n is prime."""
    if n < 2:
        return False
    for d in range(2, math.isqrt(n) + 1):
        if n % d == 0:
            return False
    return True
''', '''
def check(candidate):
    assert candidate(6) == False
    assert candidate(101) == True
    assert candidate(11) == True
    assert candidate(13441) == True
    assert candidate(61) == True
    assert candidate(4) == False
    assert candidate(1) == False
    assert candidate(5 * 17) == False
    assert candidate({k} * {k}) == False
'''),
    ("word_frequencies", '''
import re
from collections import Counter


def {name}(text: str, top: int) -> list:
    """The top most frequent lower-cased words, ties broken alphabetically."""
    counts = Counter(re.findall(r"[a-z']+", text.lower()))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:top]
''', '''
def check(candidate):
    assert candidate('a b a c b a', 2) == [('a', 3), ('b', 2)]
    assert candidate('The the THE cat', 1) == [('the', 3)]
    assert candidate('', 3) == []
    assert candidate('x y z', 5) == [('x', 1), ('y', 1), ('z', 1)]
    assert candidate('w ' * {k}, 1) == [('w', {k})]
'''),
]


def humaneval_like(n=164):
    """n correct (solution, check snippet, entry point) triples, HumanEval-shaped."""
    samples = []
    for i in range(n):
        stem, solution, check = _PROBLEMS[i % len(_PROBLEMS)]
        name, k = f"{stem}_{i}", 2 + i % 7
        samples.append((solution.format(name=name, k=k), check.format(k=k), name))
    return samples
