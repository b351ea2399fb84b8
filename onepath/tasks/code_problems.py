"""The embedded code task's problems, written for onepath: small functions on strings, lists and numbers.

A Problem is a function to write: its name and arguments, what it must return, a reference body and
test cases (arguments, expected value), JSON values all. A Family is a problem with a constant k in
its text, one Problem per k; its cases come from a plain expression of k, written apart from the
reference body, so tests/tasks/test_code.py checking every reference against its cases in the sandbox
checks two writings against each other.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    name: str
    args: str
    text: str      # what it returns, after "Write name(args): "
    body: str      # the reference body, unindented; lines joined by "\n"
    cases: tuple   # ((args...), expected), ...

    @property
    def prompt(self) -> str:
        return f"Write {self.name}({self.args}): {self.text}"

    @property
    def solution(self) -> str:
        lines = self.body.split("\n")
        return f"def {self.name}({self.args}):\n" + "".join(f"    {line}\n" for line in lines)


@dataclass(frozen=True)
class Family:
    name: str
    args: str
    text: str      # with {k}
    body: str      # with {k}
    cases: object  # k -> ((args...), expected), ...
    ks: tuple = tuple(range(2, 10))

    def problems(self) -> list[Problem]:
        return [Problem(self.name, self.args, self.text.format(k=k), self.body.format(k=k), tuple(self.cases(k)))
                for k in self.ks]


PROBLEMS = (
    # strings
    Problem("reverse_string", "s", "return s reversed.", "return s[::-1]",
            ((("abc",), "cba"), (("",), ""), (("ab a",), "a ba"))),
    Problem("is_palindrome", "s", "return True if s reads the same backwards.", "return s == s[::-1]",
            ((("aba",), True), (("ab",), False), (("",), True), (("abba",), True))),
    Problem("count_vowels", "s", "return how many letters of s are in aeiou.", "return sum(c in 'aeiou' for c in s)",
            ((("hello",), 2), (("xyz",), 0), (("aeiou",), 5))),
    Problem("to_upper", "s", "return s in upper case.", "return s.upper()",
            ((("abc",), "ABC"), (("a1b",), "A1B"), (("",), ""))),
    Problem("first_char", "s", "return the first character of s, or '' if s is empty.", "return s[:1]",
            ((("abc",), "a"), (("",), ""), (("z",), "z"))),
    Problem("last_char", "s", "return the last character of s, or '' if s is empty.", "return s[-1:]",
            ((("abc",), "c"), (("",), ""), (("z",), "z"))),
    Problem("count_char", "s, c", "return how many times c occurs in s.", "return s.count(c)",
            ((("banana", "a"), 3), (("abc", "z"), 0), (("aaa", "a"), 3))),
    Problem("remove_spaces", "s", "return s without its spaces.", "return s.replace(' ', '')",
            ((("a b c",), "abc"), (("  ",), ""), (("xy",), "xy"))),
    Problem("word_count", "s", "return the number of words in s.", "return len(s.split())",
            ((("a b c",), 3), (("",), 0), (("  hi  ",), 1))),
    Problem("capitalize_words", "s", "return s with the first letter of each word in upper case.", "return s.title()",
            ((("hello world",), "Hello World"), (("a",), "A"), (("",), ""))),
    Problem("longest_word", "s", "return the longest word of s, the first one on ties.", "return max(s.split(), key=len)",
            ((("a bbb cc",), "bbb"), (("xy z",), "xy"), (("aa bb",), "aa"))),
    Problem("double_chars", "s", "return s with each character written twice.", "return ''.join(c * 2 for c in s)",
            ((("ab",), "aabb"), (("",), ""), (("x y",), "xx  yy"))),
    Problem("is_digits", "s", "return True if s is not empty and all digits.", "return s.isdigit()",
            ((("123",), True), (("12a",), False), (("",), False))),
    Problem("swap_case", "s", "return s with upper and lower case swapped.", "return s.swapcase()",
            ((("aB",), "Ab"), (("ABC",), "abc"), (("1x",), "1X"))),
    Problem("starts_with", "s, p", "return True if s starts with p.", "return s.startswith(p)",
            ((("hello", "he"), True), (("hello", "lo"), False), (("", ""), True))),
    Problem("repeat_string", "s, n", "return s repeated n times.", "return s * n",
            ((("ab", 3), "ababab"), (("x", 0), ""), (("", 5), ""))),
    Problem("join_words", "words", "return the words joined by single spaces.", "return ' '.join(words)",
            (((["a", "b"],), "a b"), (([],), ""), ((["x"],), "x"))),
    Problem("char_codes", "s", "return the list of the character codes of s.", "return [ord(c) for c in s]",
            ((("AB",), [65, 66]), (("",), []), (("a",), [97]))),
    Problem("count_upper", "s", "return how many upper case letters s has.", "return sum(c.isupper() for c in s)",
            ((("aBC",), 2), (("abc",), 0), (("A1A",), 2))),
    Problem("middle_char", "s", "return the character of s at index len(s) // 2.", "return s[len(s) // 2]",
            ((("abc",), "b"), (("abcd",), "c"), (("x",), "x"))),
    # lists
    Problem("sum_list", "xs", "return the sum of the numbers in xs.", "return sum(xs)",
            ((([1, 2, 3],), 6), (([],), 0), (([-1, 1],), 0))),
    Problem("max_list", "xs", "return the largest number in xs.", "return max(xs)",
            ((([1, 5, 2],), 5), (([-3, -1],), -1), (([7],), 7))),
    Problem("min_list", "xs", "return the smallest number in xs.", "return min(xs)",
            ((([4, 1, 3],), 1), (([-3, -1],), -3), (([7],), 7))),
    Problem("count_even", "xs", "return how many numbers in xs are even.", "return sum(x % 2 == 0 for x in xs)",
            ((([1, 2, 4],), 2), (([],), 0), (([3, 5],), 0))),
    Problem("only_even", "xs", "return the even numbers of xs, in order.", "return [x for x in xs if x % 2 == 0]",
            ((([1, 2, 3, 4],), [2, 4]), (([],), []), (([5, 7],), []))),
    Problem("squares", "xs", "return the square of each number in xs.", "return [x * x for x in xs]",
            ((([1, 2, 3],), [1, 4, 9]), (([],), []), (([-2],), [4]))),
    Problem("reverse_list", "xs", "return xs in reverse order.", "return xs[::-1]",
            ((([1, 2, 3],), [3, 2, 1]), (([],), []), (([5],), [5]))),
    Problem("product", "xs", "return the product of the numbers in xs, 1 if xs is empty.",
            "p = 1\nfor x in xs:\n    p *= x\nreturn p",
            ((([2, 3],), 6), (([],), 1), (([5, 0],), 0), (([-2, 4],), -8))),
    Problem("first_last", "xs", "return a list of the first and the last element of xs.", "return [xs[0], xs[-1]]",
            ((([1, 2, 3],), [1, 3]), (([4],), [4, 4]), (([5, 6],), [5, 6]))),
    Problem("unique", "xs", "return the distinct elements of xs in order of first appearance.",
            "return list(dict.fromkeys(xs))",
            ((([1, 2, 1, 3],), [1, 2, 3]), (([],), []), (([5, 5],), [5]))),
    Problem("sorted_list", "xs", "return the numbers of xs in increasing order.", "return sorted(xs)",
            ((([3, 1, 2],), [1, 2, 3]), (([],), []), (([2, 2, 1],), [1, 2, 2]))),
    Problem("second_largest", "xs", "return the second largest distinct number in xs.", "return sorted(set(xs))[-2]",
            ((([1, 3, 2],), 2), (([5, 5, 4],), 4), (([1, 2],), 1))),
    Problem("count_positive", "xs", "return how many numbers in xs are above 0.", "return sum(x > 0 for x in xs)",
            ((([1, -2, 3],), 2), (([],), 0), (([0, -1],), 0))),
    Problem("running_sum", "xs", "return the list of the sums of the first 1, 2, ... numbers of xs.",
            "out, t = [], 0\nfor x in xs:\n    t += x\n    out.append(t)\nreturn out",
            ((([1, 2, 3],), [1, 3, 6]), (([],), []), (([5],), [5]), (([2, -2, 1],), [2, 0, 1]))),
    Problem("index_of", "xs, v", "return the index of the first v in xs, or -1 if v is not there.",
            "return xs.index(v) if v in xs else -1",
            ((([4, 5, 6], 5), 1), (([4, 5, 6], 7), -1), (([1, 1], 1), 0))),
    Problem("flatten", "xss", "return the elements of the lists in xss in one list.",
            "return [x for xs in xss for x in xs]",
            ((([[1, 2], [3]],), [1, 2, 3]), (([],), []), (([[], [4]],), [4]))),
    Problem("pairwise_sum", "xs, ys", "return the list of xs[i] + ys[i].", "return [x + y for x, y in zip(xs, ys)]",
            ((([1, 2], [3, 4]), [4, 6]), (([], []), []), (([-1], [1]), [0]))),
    Problem("all_positive", "xs", "return True if every number in xs is above 0.", "return all(x > 0 for x in xs)",
            ((([1, 2],), True), (([1, -2],), False), (([],), True))),
    Problem("max_index", "xs", "return the index of the largest number in xs, the first one on ties.",
            "return xs.index(max(xs))",
            ((([1, 5, 2],), 1), (([7, 7],), 0), (([3],), 0))),
    Problem("count_greater", "xs, t", "return how many numbers in xs are above t.", "return sum(x > t for x in xs)",
            ((([1, 5, 9], 4), 2), (([], 0), 0), (([3, 3], 3), 0))),
    Problem("rotate_left", "xs", "return xs with its first element moved to the end.", "return xs[1:] + xs[:1]",
            ((([1, 2, 3],), [2, 3, 1]), (([],), []), (([5],), [5]))),
    Problem("sum_odd_positions", "xs", "return the sum of the elements of xs at odd indices.", "return sum(xs[1::2])",
            ((([1, 2, 3, 4],), 6), (([],), 0), (([5],), 0))),
    # numbers
    Problem("is_even", "n", "return True if n is even.", "return n % 2 == 0",
            (((4,), True), ((7,), False), ((0,), True), ((-2,), True))),
    Problem("absolute", "n", "return the absolute value of n.", "return abs(n)",
            (((-3,), 3), ((0,), 0), ((5,), 5))),
    Problem("factorial", "n", "return n! for n >= 0.", "r = 1\nfor i in range(2, n + 1):\n    r *= i\nreturn r",
            (((0,), 1), ((5,), 120), ((3,), 6))),
    Problem("fib", "n", "return the n-th Fibonacci number, fib(0) = 0 and fib(1) = 1.",
            "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a",
            (((0,), 0), ((1,), 1), ((10,), 55), ((7,), 13))),
    Problem("digit_sum", "n", "return the sum of the digits of n >= 0.", "return sum(int(d) for d in str(n))",
            (((123,), 6), ((0,), 0), ((909,), 18))),
    Problem("is_prime", "n", "return True if n is a prime number.", "return n > 1 and all(n % d for d in range(2, n))",
            (((2,), True), ((9,), False), ((1,), False), ((13,), True))),
    Problem("gcd", "a, b", "return the greatest common divisor of a and b.", "while b:\n    a, b = b, a % b\nreturn a",
            (((12, 18), 6), ((7, 3), 1), ((0, 5), 5))),
    Problem("count_digits", "n", "return the number of digits of n >= 0.", "return len(str(n))",
            (((123,), 3), ((0,), 1), ((99999,), 5))),
    Problem("max_of_three", "a, b, c", "return the largest of a, b and c.", "return max(a, b, c)",
            (((1, 2, 3), 3), ((5, 2, 1), 5), ((-1, -2, -3), -1))),
    Problem("sign", "n", "return -1, 0 or 1 for n below, at or above 0.", "return (n > 0) - (n < 0)",
            (((-5,), -1), ((0,), 0), ((8,), 1))),
    Problem("sum_to", "n", "return 1 + 2 + ... + n.", "return n * (n + 1) // 2",
            (((3,), 6), ((1,), 1), ((10,), 55), ((0,), 0))),
    Problem("power_of_two", "n", "return True if n is a power of two.", "return n > 0 and n & (n - 1) == 0",
            (((1,), True), ((8,), True), ((6,), False), ((0,), False))),
    Problem("reverse_number", "n", "return the number with the digits of n >= 0 reversed.", "return int(str(n)[::-1])",
            (((123,), 321), ((100,), 1), ((7,), 7))),
    Problem("leap_year", "y", "return True if y is a leap year.",
            "return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)",
            (((2000,), True), ((1900,), False), ((2024,), True), ((2023,), False))),
    Problem("binary", "n", "return n >= 0 in binary, without a prefix.", "return bin(n)[2:]",
            (((5,), "101"), ((0,), "0"), ((8,), "1000"))),
    Problem("count_divisors", "n", "return how many numbers from 1 to n divide n.",
            "return sum(n % d == 0 for d in range(1, n + 1))",
            (((6,), 4), ((1,), 1), ((7,), 2))),
    # dicts
    Problem("char_freq", "s", "return a dict of each character of s to how often it occurs.",
            "d = {}\nfor c in s:\n    d[c] = d.get(c, 0) + 1\nreturn d",
            ((("aab",), {"a": 2, "b": 1}), (("",), {}), (("xyx",), {"x": 2, "y": 1}))),
    Problem("invert_dict", "d", "return a dict of each value of d to its key.", "return {v: k for k, v in d.items()}",
            ((({"a": "x"},), {"x": "a"}), (({},), {}), (({"a": "b", "c": "d"},), {"b": "a", "d": "c"}))),
)

FAMILIES = (
    Family("add", "x", "return x plus {k}.", "return x + {k}",
           lambda k: (((0,), k), ((5,), 5 + k), ((-3,), k - 3))),
    Family("times", "x", "return x times {k}.", "return x * {k}",
           lambda k: (((0,), 0), ((3,), 3 * k), ((-2,), -2 * k))),
    Family("remainder", "x", "return the remainder of x divided by {k}.", "return x % {k}",
           lambda k: (((10,), 10 % k), ((7,), 7 % k), ((23,), 23 % k))),
    Family("multiples", "n", "return the list of the first n multiples of {k}.", "return [{k} * i for i in range(1, n + 1)]",
           lambda k: (((3,), [k, 2 * k, 3 * k]), ((0,), []), ((1,), [k]))),
    Family("repeat", "s", "return s repeated {k} times.", "return s * {k}",
           lambda k: ((("a",), "a" * k), (("",), ""), (("xy",), "xy" * k))),
    Family("take", "xs", "return the first {k} elements of xs.", "return xs[:{k}]",
           lambda k: ((([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],), list(range(1, k + 1))), (([],), []), (([7],), [7]))),
    Family("above", "xs", "return the numbers of xs above {k}, in order.", "return [x for x in xs if x > {k}]",
           lambda k: ((([1, 5, 9],), [x for x in (1, 5, 9) if x > k]), (([],), []), (([k, k + 1],), [k + 1]))),
    Family("divisible", "n", "return True if n is divisible by {k}.", "return n % {k} == 0",
           lambda k: (((k * 3,), True), ((k + 1,), False), ((0,), True), ((k - 1,), False))),
)


def all_problems() -> list[Problem]:
    """Every problem, the families' variants after the others; prompts are distinct."""
    return list(PROBLEMS) + [p for family in FAMILIES for p in family.problems()]
