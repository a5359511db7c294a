"""A radix prefix cache without an allocator of its own (sglang-RadixCache-like): a trie
over key items, one item per node, with lock counts taken and dropped by the caller, LRU
eviction of unlocked leaves and an evictable-size counter.

BUG: insert counts every item it walks as evictable, including items already cached, so a
re-inserted prefix is counted twice and evictable_size overstates what evict can free."""


class Node:
    def __init__(self, key=(), value=None, parent=None):
        self.key = key
        self.value = value if value is not None else []
        self.children = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0


class PrefixTree:
    def __init__(self):
        self.root = Node()
        self._evictable = 0
        self._clock = 0

    def _tick(self):
        self._clock += 1
        return self._clock

    def match_prefix(self, key):
        """The values cached for the longest prefix of ``key``, and the node it ends at."""
        node, values = self.root, []
        for item in key:
            child = node.children.get(item)
            if child is None:
                break
            child.last_access = self._tick()
            values.extend(child.value)
            node = child
        return values, node

    def insert(self, key, value):
        """Cache ``value[i]`` for the prefix ``key[:i + 1]``; a prefix already cached keeps
        its value. Returns how many items were already cached."""
        node, present = self.root, 0
        for i, item in enumerate(key):
            child = node.children.get(item)
            if child is None:
                child = Node((item,), [value[i]], node)
                node.children[item] = child
                self._evictable += 1
            else:
                present += 1
                self._evictable += 1
            child.last_access = self._tick()
            node = child
        return present

    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= 1
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += 1
            node = node.parent

    def evictable_size(self):
        return self._evictable

    def _leaves(self):
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root and n.lock_ref == 0:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num):
        """Evict least recently used unlocked leaves until ``num`` values are freed."""
        freed = []
        while len(freed) < num:
            leaves = self._leaves()
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_access)
            del victim.parent.children[victim.key[0]]
            self._evictable -= 1
            freed.extend(victim.value)
        return freed
