# distutils: language = c++
"""Python's view of the native pipeline's rules: the stage lists (core/pipeline/bps_stages.h), which
``bpslaunch --stages`` and core/stages.py read from here, and :class:`PriorityQueue`, the binding of
the priority queue with a byte credit that byteps-net's send queue and the stage thread use
(core/pipeline/bps_queue.h has its rules), through which tests/test_pipeline_queue.py checks them on
the very code the core runs. Waiting happens in C with the GIL released.
"""
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp cimport bool as cbool

cdef extern from "core/pipeline/bps_stages.h" nogil:
    ctypedef struct BpsStageName:
        int32_t code
        const char *name
    const BpsStageName BPS_STAGE_NAMES[]
    const int BPS_STAGE_COUNT
    cdef cppclass BpsStageList:
        int32_t n
        int32_t stage[12]
    BpsStageList bps_stage_list(int32_t kind, cbool owner, cbool local_reduce, cbool colocated, cbool lone_machine,
                                cbool gpu, cbool root)
    BpsStageList bps_nccl_stage_list(cbool root, cbool colocated, cbool lone_machine, cbool divides)

#: operation kinds of bps_stages.h BpsOpKind, by the names tensor declarations use
OP_KINDS = {"push_pull": 0, "broadcast": 1, "async push_pull": 2}


def stage_names():
    """{code: name} of every stage and span kind of bps_stages.h, in code order."""
    return {BPS_STAGE_NAMES[i].code: BPS_STAGE_NAMES[i].name.decode() for i in range(BPS_STAGE_COUNT)}


def stage_codes(kind, bint owner, bint local_reduce, bint colocated, bint lone_machine, bint gpu=False,
                bint root=False):
    """The stage codes of one partition, in order, by bps_stage_list(): the rule the native core runs
    (``gpu``: a CUDA tensor's; ``root``: this process is a broadcast's root)."""
    cdef BpsStageList got = bps_stage_list(OP_KINDS[kind], owner, local_reduce, colocated, lone_machine, gpu, root)
    return tuple(got.stage[i] for i in range(got.n))


def nccl_stage_codes(bint root, bint colocated, bint lone_machine, bint divides):
    """The stage codes of one partition of a CUDA push_pull on the NCCL stages, by bps_nccl_stage_list()
    (``root``: this process's GPU gets the machine's sum; ``divides``: an average)."""
    cdef BpsStageList got = bps_nccl_stage_list(root, colocated, lone_machine, divides)
    return tuple(got.stage[i] for i in range(got.n))


cdef extern from "core/pipeline/bps_queue.h" nogil:
    cdef cppclass BpsQueue:
        BpsQueue(int64_t credit)
        void push(int64_t priority, uint64_t tie, int64_t id, int64_t nbytes)
        int pop(int64_t *id, int64_t timeout_ms, int64_t stall_ms)
        void release(int64_t nbytes, int64_t priority, uint64_t tie)
        void close()
        int64_t size()
        int64_t in_flight()
        int64_t credit()


cdef class PriorityQueue:
    """A thread-safe priority queue of integer task ids with a byte credit.

    Args:
        credit: the most bytes handed out by :meth:`pop` and not yet :meth:`release`-d; a task
            larger than the credit still runs when nothing else is in flight, and a task more
            urgent than everything in flight always runs (bps_queue.h says why). 0: unlimited.
    """

    cdef BpsQueue *q
    cdef public bint past_credit  # the last pop() handed out a task past the credit (a stall)

    def __cinit__(self, int64_t credit=0):
        self.q = new BpsQueue(credit)

    def __dealloc__(self):
        del self.q

    def push(self, int64_t priority, int64_t task_id, int64_t nbytes=0, uint64_t tie=0):
        """Queue a task (``tie`` orders equal priorities: smaller first)."""
        with nogil:
            self.q.push(priority, tie, task_id, nbytes)

    def pop(self, double timeout=0.0, double stall=0.0):
        """The best task id that fits the credit, or None after ``timeout`` seconds (negative: wait forever).

        With ``stall`` > 0, the best task also goes when nothing was taken or released for that many
        seconds (``past_credit`` then reads True): for workers that disagree on urgency (bps_queue.h).
        """
        cdef int64_t task_id = 0
        cdef int64_t ms = -1 if timeout < 0 else <int64_t>(timeout * 1000)
        cdef int64_t stall_ms = <int64_t>(stall * 1000)
        cdef int ok
        with nogil:
            ok = self.q.pop(&task_id, ms, stall_ms)
        self.past_credit = ok == 2
        return task_id if ok else None

    def release(self, int64_t nbytes, int64_t priority=0, uint64_t tie=0):
        """Give back the credit of a finished task (``priority``, ``tie``: those it was pushed with)."""
        with nogil:
            self.q.release(nbytes, priority, tie)

    def close(self):
        """Wake every waiter; pop() returns None once the queue is empty."""
        with nogil:
            self.q.close()

    def __len__(self):
        return self.q.size()

    @property
    def in_flight(self):
        """Bytes handed out and not yet released."""
        return self.q.in_flight()

    @property
    def credit(self):
        return self.q.credit()
