"""A tiny HTML DOM for the viewer tests (stdlib html.parser; checks nesting)."""

from html.parser import HTMLParser

VOID = {"meta", "img", "input", "br", "link", "hr"}


class Dom(HTMLParser):
    """Flat list of elements: {"tag", "attrs", "text", "parents"}."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.elements, self.stack = [], []
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed tags: {[e['tag'] for e in self.stack]}"

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "text": "", "parents": list(self.stack)}
        self.elements.append(el)
        if tag not in VOID:
            self.stack.append(el)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1]["tag"] == tag, f"mismatched </{tag}>"
        self.stack.pop()

    def handle_data(self, data):
        for el in self.stack:
            el["text"] += data

    def find(self, tag=None, cls=None, id=None, within=None):
        return [el for el in self.elements
                if (tag is None or el["tag"] == tag)
                and (cls is None or cls in el["attrs"].get("class", "").split())
                and (id is None or el["attrs"].get("id") == id)
                and (within is None or any(p is within for p in el["parents"]))]
