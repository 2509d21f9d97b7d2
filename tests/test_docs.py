"""docs/method.md is the design document the code cites: every citation must
name one of its numbered sections, and no file may cite METHOD.md or
notes/CONTRACT.md, which are not in the repository."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / 'docs' / 'method.md'
# "docs/method.md section 3", "sections 2-5", "sections 1, 6, 8 and 9", across
# a line break too.
CITATION = re.compile(
    r'docs/method\.md\s+sections?\s+'
    r'(\d+(?:\s*-\s*\d+)?(?:\s*(?:,|and|,\s*and)\s*\d+(?:\s*-\s*\d+)?)*)')
OLD = re.compile(r'METHOD\.md|CONTRACT\.md')


def _tracked_text_files():
  names = subprocess.run(['git', 'ls-files'], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
  for name in names:
    path = ROOT / name
    if path.suffix in ('.py', '.md', '.txt', '.cfg', '.toml') and (
        path.is_file()):
      yield path


def _sections(text):
  """Numbers N of the '## N. Title' headings."""
  return {int(n) for n in re.findall(r'^## (\d+)\. \S', text, re.M)}


def _cited(spec):
  numbers = set()
  for part in re.split(r'\s*(?:,\s*and|,|and)\s*', spec):
    if '-' in part:
      lo, hi = (int(p) for p in part.split('-'))
      numbers.update(range(lo, hi + 1))
    elif part:
      numbers.add(int(part))
  return numbers


def test_citation_parser():
  assert _cited('3') == {3}
  assert _cited('2-5') == {2, 3, 4, 5}
  assert _cited('1, 6, 8 and 9') == {1, 6, 8, 9}
  assert _cited('1 and 4-6') == {1, 4, 5, 6}


def test_sections_are_numbered_in_order():
  numbers = re.findall(r'^## (\d+)\. ', DOC.read_text(), re.M)
  assert [int(n) for n in numbers] == list(range(1, len(numbers) + 1))


def test_every_citation_resolves_and_no_old_reference_remains():
  sections = _sections(DOC.read_text())
  assert sections, 'docs/method.md has no numbered sections'
  citations, stale = [], []
  for path in _tracked_text_files():
    text = path.read_text(errors='replace')
    rel = path.relative_to(ROOT)
    if path.name != 'test_docs.py':
      stale += [f'{rel}: {m.group(0)}' for m in OLD.finditer(text)]
    for match in CITATION.finditer(text):
      citations.append((rel, match.group(0), _cited(match.group(1))))
  assert not stale, f'references to documents outside the repository: {stale}'
  # The code, tests, configs and README cite the document in many places.
  assert len(citations) >= 20
  missing = [(str(rel), text) for rel, text, numbers in citations
             if not numbers <= sections]
  assert not missing, f'citations of sections docs/method.md lacks: {missing}'
